"""Streamed text: the pieces a ``StreamingDetokenizer`` hands out join to
the tokenizer's decode of all the ids, in any chunking, and none of them
changes later; decoding costs a few ids per generated token; the events of a
generation are snapshots that copy nothing (``Prefix``)."""

import io
import json
import random

import pytest
import sentencepiece as spm
from fixtures import EOS_ID, PAD_ID, UNK_ID, training_sentences
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, T5Tokenizer

from decoder import SpeculativeDecoder
from detokenizer import CONTEXT, StreamingDetokenizer
from loading import load_tokenizer
from scheduler import Prefix

# Characters of two, three and four UTF-8 bytes: the test tokenizer has
# pieces for the umlauts; the byte-fallback one spells the rest in bytes.
MULTI_BYTE_TEXTS = (
    "Grüße aus Köln: 你好, 世界 😀 naïve café €5",
    "Das Mädchen trägt 🙂🙂 und ß; 東京 ist groß.",
    "Le garçon très âgé 😀你 é",
)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer(tmp_path_factory):
    """A SentencePiece tokenizer with byte fallback, decoded as Llama's is:
    the test tokenizer's corpus with some multi-byte characters, several of
    them too rare for pieces of their own (the conversion to Hugging Face's
    format leaves byte fallback off, so it is turned on in tokenizer.json)."""
    directory = tmp_path_factory.mktemp("byte-fallback")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_sentences() + list(MULTI_BYTE_TEXTS[:1]) * 3),
        model_writer=model,
        vocab_size=400,
        model_type="unigram",
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        bos_id=-1,
        byte_fallback=True,
        character_coverage=0.9995,
        num_threads=1,
        minloglevel=2,
    )
    (directory / "spiece.model").write_bytes(model.getvalue())
    T5Tokenizer.from_pretrained(directory, extra_ids=0).save_pretrained(directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    ids = tokenizer(MULTI_BYTE_TEXTS[1]).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == MULTI_BYTE_TEXTS[1]
    assert "<0xF0>" in tokenizer.convert_ids_to_tokens(ids)  # the emoji, in bytes
    return tokenizer


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's kind): its decoder joins the bytes
    of all pieces and marks a character cut short with U+FFFD."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_sentences() + list(MULTI_BYTE_TEXTS[:1]), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def tokenizers(tokenizer_dir, byte_fallback_tokenizer):
    """The test tokenizer as decoder.py loads it, the same cleaning up spaces
    (" ." to "."), the byte-fallback one and a byte-level one."""
    return {
        "sentencepiece": load_tokenizer(tokenizer_dir),
        "cleaning up spaces": AutoTokenizer.from_pretrained(
            tokenizer_dir, clean_up_tokenization_spaces=True
        ),
        "byte fallback": byte_fallback_tokenizer,
        "byte level": byte_level_tokenizer(),
    }


def id_sequences(tokenizer, rng: random.Random) -> list[list[int]]:
    """Random ids of the whole vocabulary (special tokens included), random
    ids of its byte pieces, spaces and special tokens, and the ids of real
    texts."""
    vocab = tokenizer.get_vocab()
    every = list(vocab.values())
    bytes_and_spaces = [i for piece, i in vocab.items() if piece.startswith(("<0x", "▁"))]
    bytes_and_spaces += tokenizer.all_special_ids
    sequences = [[rng.choice(every) for _ in range(60)] for _ in range(20)]
    sequences += [[rng.choice(bytes_and_spaces) for _ in range(60)] for _ in range(10)]
    texts = MULTI_BYTE_TEXTS + ("a ' b , c . d n't e 'm f ?", "the house . is ! small")
    sequences += [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    return sequences


def chunkings(ids: list[int], rng: random.Random) -> list[list[list[int]]]:
    """``ids`` one at a time, and in random chunks of 1 to 6."""
    random_chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 6)
        random_chunks.append(ids[start : start + size])
        start += size
    return [[[token] for token in ids], random_chunks]


def ends_in_bytes(ids: list[int], byte_ids: set[int], special_ids: set[int]) -> bool:
    """Whether ``ids`` end in byte pieces, special tokens aside (they vanish
    before the bytes are joined)."""
    text_ids = [token for token in ids if token not in special_ids]
    return bool(text_ids) and text_ids[-1] in byte_ids


@pytest.mark.parametrize(
    "kind", ["sentencepiece", "cleaning up spaces", "byte fallback", "byte level"]
)
def test_streamed_text_is_the_decode_of_every_id(kind, tokenizers):
    tokenizer = tokenizers[kind]
    rng = random.Random(0)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    byte_ids = {i for piece, i in tokenizer.get_vocab().items() if piece.startswith("<0x")}
    special_ids = set(tokenizer.all_special_ids)
    for ids in id_sequences(tokenizer, rng):
        whole = decode(ids)
        for chunks in chunkings(ids, rng):
            detokenizer = StreamingDetokenizer(tokenizer)
            streamed, seen = "", []
            for n, chunk in enumerate(chunks):
                seen += chunk
                last = n == len(chunks) - 1
                streamed += detokenizer.add(chunk, last=last)
                so_far = decode(seen)
                # Handed out only what no later id changes...
                assert so_far.startswith(streamed) and whole.startswith(streamed)
                # ...and all of it but what a later id may change.
                if last or kind == "sentencepiece":
                    assert streamed == so_far
                elif kind == "byte level" or not ends_in_bytes(seen, byte_ids, special_ids):
                    if kind == "cleaning up spaces":
                        assert len(streamed) >= so_far.rfind(" ")
                    else:
                        assert streamed == so_far.rstrip("\ufffd")
            assert streamed == whole


class CountingTokenizer:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_ids = 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


# Ids decoded per new id, one at a time: the window of 1.5 * CONTEXT ids on
# average plus the new one, and CONTEXT more each time it is shortened (every
# CONTEXT ids).
IDS_PER_TOKEN = 1.5 * CONTEXT + 2


def test_decoding_costs_a_few_ids_per_token(tokenizers):
    """300 ids one at a time: of real text, of text then special tokens
    alone (a model past its end), of text then spaces alone."""
    tokenizer = CountingTokenizer(tokenizers["byte fallback"])
    text = tokenizer(" ".join(MULTI_BYTE_TEXTS * 10), add_special_tokens=False).input_ids
    space = tokenizer.convert_tokens_to_ids("▁")
    for ids in (text[:300], text[:20] + [EOS_ID, PAD_ID] * 140, text[:20] + [space] * 280):
        assert len(ids) == 300
        tokenizer.decoded_ids = 0
        detokenizer = StreamingDetokenizer(tokenizer)
        streamed = "".join(detokenizer.add([token]) for token in ids[:-1])
        streamed += detokenizer.add(ids[-1:], last=True)
        assert tokenizer.decoded_ids <= IDS_PER_TOKEN * len(ids)
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_generation_decodes_a_few_ids_per_token(decoding_pair):
    model, draft_model, tokenizer = decoding_pair
    counting = CountingTokenizer(tokenizer)
    decoder = SpeculativeDecoder(model, draft_model, counting, num_draft=1)
    events = list(decoder.stream("Le chat est très petit.", max_tokens=300, speculative=False))
    tokens = events[-1].tokens
    assert len(tokens) == 300, "the fixture model ends too soon to test this"
    assert counting.decoded_ids <= IDS_PER_TOKEN * len(tokens)
    assert events[-1].text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert all(events[-1].text.startswith(event.text) for event in events)


def test_a_prefix_is_a_snapshot_of_a_growing_list():
    items = [3, 1, 4]
    prefix = Prefix(items)
    items += [1, 5]
    assert prefix == [3, 1, 4] and [3, 1, 4] == prefix and prefix != items
    assert len(prefix) == 3 and list(prefix) == [3, 1, 4] and 1 in prefix and 5 not in prefix
    assert prefix[-1] == 4 and prefix[1:] == [1, 4] and prefix[::-1] == [4, 1, 3]
    assert prefix[5:] == [] and repr(prefix) == "[3, 1, 4]"
    with pytest.raises(IndexError):
        prefix[3]
