"""Helpers for tests that run the real tritonserver: a tiny model (its fixtures, `checkpoint`, `session` and
`expected`, are tests/conftest.py's), the prompts compared, a filled model repository, and the server itself
(serving/triton/launcher.py as a library).

The tiny checkpoint has a byte-level BPE trained here on mixed ASCII/CJK/emoji text, so many
tokens are pieces of a multi-byte character: random weights then generate split characters,
the hard case for streaming UTF-8. Nothing depends on files outside the repository.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from builder.hf_writer import write_hf_checkpoint
from conftest import random_tensors, tiny_config_dict
from runtime.model.config import ModelConfig
from serving.triton.launcher import TritonServer, start_server
from serving.triton.model_repo import TEMPLATE_REPO, add_model, default_values, fill_model_repo


BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "def f(x):\n    return x * 2\n",
    "日本語のテキスト、中文的文本和한국어 텍스트",
    "東京は日本の首都です。北京是中国的首都。",
    "emoji 😀👍🏽 🇯🇵 naïve café",
]


TOKENS = 24  # generated per request in the comparisons with the session
PROMPTS = ["hello world", "日本語のテキスト", "def f(x):", "emoji 😀 and 東京", "the quick brown fox", "中文的文本",
           "naïve café", "return x * 2", "한국어", "北京是中国的首都", "lazy dog", "fox jumps", "東京は日本の首都です",
           "hello 日本", "quick", "🇯🇵 flag"]


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Write tokenizer.json + tokenizer_config.json (DeepSeek-style specials at ids 0-2); return
    the vocabulary size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)])
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"add_bos_token": True, "bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size(with_added_tokens=True)


def make_tiny_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """A random tiny DeepSeek-V3 + MTP checkpoint (HF layout) with its tokenizer."""
    tok_dir = out_dir.parent / f"{out_dir.name}-tokenizer"
    vocab = build_tokenizer(tok_dir)
    cfg = ModelConfig.from_dict(tiny_config_dict(vocab_size=vocab, eos_token_id=1, bos_token_id=0,
                                                 max_position_embeddings=1024))
    return write_hf_checkpoint(out_dir, cfg, random_tensors(cfg, seed), tokenizer_dir=tok_dir)


def repo_values(engine_dir: Path, **overrides: str) -> dict[str, str]:
    """The substitutions a test deployment uses: fixed speculation, short polling periods."""
    return default_values(engine_dir, **{"triton_max_batch_size": "16", "speculation": "fixed",
                                         "cancellation_check_period_ms": "20", "stats_check_period_ms": "50",
                                         **overrides})


__all__ = ["PROMPTS", "TEMPLATE_REPO", "assert_no_stub_crash", "TOKENS", "TritonServer", "add_model", "fill_model_repo", "make_tiny_checkpoint", "repo_values",
           "start_server"]


def assert_no_stub_crash(server: TritonServer) -> None:
    """After a server's tests, refused requests included, and its shutdown: no Python backend stub crashed (a crash at
    shutdown is invisible to every request)."""
    crashes = server.stub_crashes()
    assert not crashes, f"{crashes} Python backend stub(s) crashed: {server.log_path}"
