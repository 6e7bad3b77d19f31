"""Fast sanity checks for the offline tokenizer/checkpoint fixtures."""

from __future__ import annotations

from pathlib import Path

import torch
from fixtures import (
    DEMO_PROMPTS,
    EOS_ID,
    ROUND_TRIP_TEXT,
    agreement_rate,
    build_checkpoint,
    build_draft,
    check_varied,
    load_hf,
    train_tokenizer,
)
from transformers import AutoTokenizer


def test_tokenizer_round_trip(tmp_path: Path) -> None:
    train_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = tokenizer(ROUND_TRIP_TEXT).input_ids
    assert len(ids) > 5
    assert ids[-1] == EOS_ID
    assert tokenizer.decode(ids, skip_special_tokens=True) == ROUND_TRIP_TEXT


def test_checkpoints_varied_and_untied(tmp_path: Path) -> None:
    train_tokenizer(tmp_path / "tok")
    tied_dir = build_checkpoint(tmp_path / "relu", tokenizer_dir=tmp_path / "tok")
    untied_dir = build_checkpoint(
        tmp_path / "gated",
        feed_forward_proj="gated-gelu",
        tied=False,
        d_kv=16,
        num_decoder_layers=3,
        tokenizer_dir=tmp_path / "tok",
    )
    check_varied(tied_dir)
    check_varied(untied_dir)

    tied = load_hf(tied_dir)
    assert tied.lm_head.weight.data_ptr() == tied.shared.weight.data_ptr()
    assert tied.config.scale_decoder_outputs

    untied = load_hf(untied_dir)
    assert not torch.equal(untied.lm_head.weight, untied.shared.weight)
    assert not untied.config.scale_decoder_outputs
    assert untied.config.num_decoder_layers == 3


def test_draft_agreement(tmp_path: Path) -> None:
    main_dir = build_checkpoint(tmp_path / "main")
    draft_dir = build_draft(main_dir, tmp_path / "draft")
    rate = agreement_rate(main_dir, draft_dir, DEMO_PROMPTS, 30)
    assert 0.3 < rate < 0.97
