"""Tokenizer loading/encoding and the streaming detokenizer.

Every test runs on a tiny byte-level BPE built here and on the shipped model's tokenizer
(models/deepseek-v3-mini, built by training/prepare_data.py). The tiny one is trained on a few
ASCII lines, so CJK and emoji are split into single-byte tokens: the hardest case for streaming.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from runtime.io.tokenizer import IncrementalDetokenizer, Tokenizer, utf8_size

DATA_DIR = Path(__file__).resolve().parents[1] / "models" / "deepseek-v3-mini"
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
THINK, END_THINK = "<think>", "</think>"
CONFIG = {"add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS, "pad_token": PAD}

SAMPLES = [
    "hello world",
    "  def f(x):\n\treturn x**2  \n",
    "日本語のテキスト 中文 한국어",
    "😀👍🏽 👨‍👩‍👧 🇯🇵",
    "e\u0301 a\u0308\u0323 Z\u0351\u0352\u0357",  # combining marks
    "naïve café ∑∫ 𝔘𝔫𝔦",
    f"{THINK}why{END_THINK} because",
    "",
]
# Characters random texts are drawn from: 1-, 2-, 3- and 4-byte UTF-8, combining marks, ZWJ.
ALPHABET = [*"abc xyz\n\t.,(){}", *"éüß∑日本語中文한😀👍🏽\u200d\u0301\u0308🇯🇵𝔘", THINK, END_THINK]


def build_tiny_byte_level(path: Path) -> Path:
    """A DeepSeek-style byte-level BPE (specials at ids 0..4, post-processor adding bos) in `path`."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD, THINK, END_THINK)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = ["hello world, the quick brown fox", "def f(x):\n    return x * 2"] * 3
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 0)])
    # As in training/prepare_data.py: <think> keeps ids 3, 4 but is not special (the JSON round trip applies it).
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    tok = Backend.from_str(tok.to_str())
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_byte_level(tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="module", params=["tiny", "data"])
def tok(request: pytest.FixtureRequest, tiny_dir: Path) -> Tokenizer:
    if request.param == "tiny":
        return Tokenizer.from_dir(tiny_dir)
    if not (DATA_DIR / "tokenizer.json").is_file():
        pytest.skip(f"{DATA_DIR / 'tokenizer.json'} missing; tiny tokenizer still tested")
    return Tokenizer.from_dir(DATA_DIR)


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True, chunk: int = 1) -> list[str]:
    """push() outputs feeding `chunk` ids at a time, then flush()."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    out = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
    assert detok.text == "".join(out)
    return out


def byte_token_id(tok: Tokenizer, byte: int) -> int:
    """Id of the token that is the single byte `byte` (every byte-level vocabulary has one)."""
    return tok.byte_table.index(bytes([byte]))


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40)))


def test_loads_config(tok: Tokenizer) -> None:
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert (tok.token_id(THINK), tok.token_id(END_THINK), tok.token_id("no such token")) == (3, 4, None)
    assert tok.special_ids == {0, 1, 2}  # <think> is kept when decoding, as in DeepSeek-R1
    assert tok.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)
    assert tok.path is not None and (tok.path / "tokenizer.json").is_file()


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=False), skip_special_tokens=False) == text
    assert "".join(stream(tok, ids)) == text


def test_encode_adds_bos_exactly_once(tok: Tokenizer) -> None:
    # The backend's post-processor adds bos too; encode must not add a second one.
    assert tok.backend.encode("hi").ids[0] == tok.bos_token_id
    ids = tok.encode("hi")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.bos_token_id not in tok.encode("hi", add_bos=False)
    assert tok.encode(BOS + "hi") == ids  # a rendered chat template already starting with bos
    assert tok.encode("") == [tok.bos_token_id]


def test_stream_matches_decode(tok: Tokenizer) -> None:
    """Token-by-token (and chunked) streaming equals decode(all ids); every chunk is whole
    characters, so no U+FFFD appears although multi-byte characters span several tokens."""
    rng = random.Random(0)
    held_back = 0
    for _ in range(150):
        text = random_text(rng)
        ids = tok.encode(text)
        if rng.random() < 0.3:
            ids.append(tok.eos_token_id)
        for skip in (True, False):
            expected = tok.decode(ids, skip_special_tokens=skip)
            for chunk in (1, rng.randint(2, 5)):
                out = stream(tok, ids, skip, chunk)
                assert "".join(out) == expected
                for piece in out:
                    assert "\ufffd" not in piece
                    piece.encode("utf-8")  # strict: no lone surrogates
                held_back += out[:-1].count("")
        assert tok.decode(ids) == text
    assert held_back > 0  # some character did span tokens and was held back


def test_text_bounds_for_a_context(tok: Tokenizer) -> None:
    """The one bound every surface puts on text before tokenizing it (OpenAI server, Triton models): no text of
    more bytes than max_text_bytes(n) tokenizes to n tokens or fewer, and each sample within it does."""
    assert tok.max_text_bytes(7) == 7 * tok.max_token_bytes
    for text in SAMPLES:
        assert utf8_size(text, "prompt") <= tok.max_text_bytes(len(tok.encode(text, add_bos=False)))


def test_a_lone_surrogate_is_no_text() -> None:
    """The one refusal of a lone surrogate (JSON's \\ud800), for Session and the OpenAI server alike."""
    assert utf8_size("日本", "prompt") == 6
    with pytest.raises(ValueError) as e:
        utf8_size("ab\ud800c", "stop[1]")
    assert str(e.value) == "stop[1] must be Unicode text; it has a lone surrogate at character 2"


def test_multibyte_char_held_back_until_complete(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    ids = tok.encode("😀", add_bos=False)
    assert len(ids) == 4  # the tiny vocabulary has only single-byte tokens for it
    assert stream(tok, ids) == ["", "", "", "😀", ""]
    detok = IncrementalDetokenizer(tok)  # `holding` says when the ids so far end inside a character
    assert [(detok.push([i]), detok.holding)[1] for i in ids] == [True, True, True, False]


def test_invalid_bytes_replaced_not_raised(tok: Tokenizer) -> None:
    a, b = tok.token_id("a"), tok.token_id("b")
    lone, lead = byte_token_id(tok, 0x80), byte_token_id(tok, 0xE6)
    assert stream(tok, [a, lone, b]) == ["a", "\ufffd", "b", ""]
    assert stream(tok, [a, lead, b]) == ["a", "", "\ufffdb", ""]  # lead byte cut off by 'b'
    assert stream(tok, [a, lead]) == ["a", "", "\ufffd"]  # incomplete tail at the end
    assert tok.decode([a, lone, b]) == "a\ufffdb"


def test_random_byte_streams_match_decode(tok: Tokenizer) -> None:
    """Replacement of ill-formed UTF-8 matches the backend's decode (maximal-subpart rule)."""
    rng = random.Random(1)
    bytes_ = (0x41, 0x80, 0x9F, 0xA0, 0xBF, 0xC0, 0xC3, 0xE0, 0xE6, 0xED, 0xF0, 0xF4, 0xF5, 0xFF)
    pool = [byte_token_id(tok, b) for b in bytes_]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_bos_eos_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("日本 ok") + [tok.eos_token_id]
    assert "".join(stream(tok, ids)) == "日本 ok"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == BOS + "日本 ok" + EOS
    # A special token between the bytes of one character is dropped and the character survives.
    nihon = tok.encode("日", add_bos=False)
    if len(nihon) > 1:
        assert "".join(stream(tok, nihon[:1] + [tok.eos_token_id] + nihon[1:])) == "日"


def test_config_variants(tmp_path: Path, tiny_dir: Path) -> None:
    """Real DeepSeek-V3 configs write tokens as AddedToken dicts and may omit add_bos_token."""
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"bos_token": {"__type": "AddedToken", "content": BOS}, "eos_token": {"content": EOS},
                               "pad_token": None}))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, None)
    assert tok.encode("hi")[0] == 0
    cfg.write_text(json.dumps({**CONFIG, "add_bos_token": False}))
    assert Tokenizer.from_dir(tmp_path).encode("hi") == Tokenizer.from_dir(tmp_path).encode("hi", add_bos=False)
    cfg.write_text(json.dumps({**CONFIG, "bos_token": "<s>"}))
    with pytest.raises(ValueError, match="tokenizer_config.json.*<s>"):
        Tokenizer.from_dir(tmp_path)
    # No tokenizer_config.json: every prompt was refused ("cannot add bos: no bos_token"), an engine built from the
    # checkpoint served no text. As transformers, bos is what tokenizer.json's post-processor adds, if anything
    from transformers import PreTrainedTokenizerFast

    cfg.unlink()
    tok = Tokenizer.from_dir(tmp_path)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert tok.bos_token_id == 0 and tok.special_ids == {0, 1, 2}
    assert tok.encode("hi") == reference.encode("hi") == [0, *tok.encode("hi", add_bos=False)]
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A {EOS}", special_tokens=[(BOS, 0),
                                                                                                   (EOS, 1)])
    backend.save(str(tmp_path / "tokenizer.json"))  # bos before and eos after: bos is still the one before
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id == 0 and tok.encode("hi") == [0, *tok.encode("hi", add_bos=False)]
    assert PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json")).encode("hi")[:-1] == tok.encode("hi")
    backend.post_processor = None  # one that adds nothing: no bos
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert tok.bos_token_id is None and tok.encode("hi") == reference.encode("hi") == tok.encode("hi", add_bos=False)


def test_missing_or_bad_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_byte_fallback_tokenizer_streams(tmp_path: Path) -> None:
    """A Llama-style SentencePiece BPE (Metaspace + <0xNN> byte fallback, no ByteLevel) takes the
    re-decoding path; it must give the same guarantees."""
    pieces = [BOS, EOS, "<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", *"abcdehlorw"]
    vocab = {t: i for i, t in enumerate(pieces)}
    tok = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    t = Tokenizer.from_dir(tmp_path)
    assert not t.is_byte_level
    rng = random.Random(2)
    for text in SAMPLES[:6] + [random_text(rng) for _ in range(60)]:
        ids = t.encode(text) + [t.eos_token_id]
        for chunk in (1, 3):
            out = stream(t, ids, chunk=chunk)
            assert "".join(out) == t.decode(ids)
            assert all("\ufffd" not in piece for piece in out)
    invalid = [vocab["a"], vocab["<0x80>"], vocab["<0xE6>"]]
    assert "".join(stream(t, invalid)) == t.decode(invalid) == "a\ufffd\ufffd"
    # a byte that decodes alone ("A") turns into U+FFFD once its run is invalid (E4 without its
    # continuation): the stream must hold the run until it closes, as decode judges it whole
    run = [vocab["a"], vocab["<0x41>"], vocab["<0xE4>"], vocab["b"]]
    assert t.decode(run) == "a\ufffd\ufffdb"
    assert "".join(stream(t, run)) == t.decode(run)
    detok = IncrementalDetokenizer(t)
    assert [(detok.push([i]), detok.holding)[1] for i in run] == [False, True, True, False]
    for _ in range(300):  # random byte runs between letters
        ids = [rng.choice([vocab["a"], vocab["b"], *(vocab[f"<0x{b:02X}>"] for b in (0x41, 0x80, 0xE4, 0xB8, 0xAD))])
               for _ in range(rng.randint(1, 10))]
        assert "".join(stream(t, ids)) == t.decode(ids), ids


def test_chat_template_from_the_config_or_its_own_file(tmp_path: Path, tiny_dir: Path) -> None:
    """As transformers saves it: a string or named templates in tokenizer_config.json (4.x), or chat_template.jinja
    beside it (>= 4.43), which wins; a template of another shape is refused naming the field."""
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps(CONFIG))
    assert Tokenizer.from_dir(tmp_path).chat_template is None
    cfg.write_text(json.dumps({**CONFIG, "chat_template": "{{ messages }}"}))
    assert Tokenizer.from_dir(tmp_path).chat_template == "{{ messages }}"
    cfg.write_text(json.dumps({**CONFIG, "chat_template": [{"name": "tool_use", "template": "T"},
                                                           {"name": "default", "template": "D"}]}))
    assert Tokenizer.from_dir(tmp_path).chat_template == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_dir(tmp_path).chat_template == "J"
    (tmp_path / "chat_template.jinja").unlink()
    cfg.write_text(json.dumps({**CONFIG, "chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: chat_template must be a string or a list of "
                                         r"\{name, template\} with a 'default'"):
        Tokenizer.from_dir(tmp_path)
