"""Tokenizer and streaming detokenizer for DeepSeek-V3-style `tokenizer.json` checkpoints.

A served model emits one token at a time, and a byte-level BPE token is a run of bytes that
need not end on a UTF-8 character boundary (a CJK character or an emoji is often split over
2-4 tokens). `IncrementalDetokenizer` turns ids into text that is valid UTF-8 at every step,
holding back incomplete characters instead of emitting replacement characters, at O(1) work
per token (no re-decoding of the whole sequence).
"""

from __future__ import annotations

import codecs
import json
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping

import tokenizers
from tokenizers import decoders

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.43 saves the chat template
TOKENIZER_FILES = (TOKENIZER_FILE, CONFIG_FILE, CHAT_TEMPLATE_FILE)  # what a checkpoint or an engine carries of its tokenizer
_REPLACEMENT = "\ufffd"


def utf8_size(text: str, name: str) -> int:
    """Its UTF-8 bytes. ValueError naming `name` for a lone surrogate (JSON's \\ud800): that is no UTF-8 text, nothing
    to tokenize or to match."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be Unicode text; it has a lone surrogate at character {e.start}") from None


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode, the alphabet ByteLevel writes tokens in: printable
    Latin-1 bytes stand for themselves, the other bytes are shifted to code points 256+."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, shift = bs[:], 256
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(shift)
            shift += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _token_content(value: Any, field: str, path: Path) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {field} must be a string or a dict with 'content', got {value!r}")


def _chat_template(value: Any, where: Path) -> str | None:
    """tokenizer_config.json's chat_template: one template, or a list of named ones (the "default" is used)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, Mapping) and isinstance(t.get("template"), str) for t in value):
        named = {t.get("name"): t["template"] for t in value}
        if "default" in named:
            return named["default"]
    raise ValueError(f"{where}: chat_template must be a string or a list of {{name, template}} with a 'default', "
                     f"got {str(value)[:80]!r}")


def _post_processor_bos(backend: tokenizers.Tokenizer) -> int | None:
    """The one token tokenizer.json's post-processor puts before a text (None: none, or several), whatever it puts
    after it (an eos, say: appended by transformers too, not here, where generation follows the prompt)."""
    plain = backend.encode("a", add_special_tokens=False).ids
    special = backend.encode("a", add_special_tokens=True).ids
    return special[0] if len(special) > len(plain) and special[1:1 + len(plain)] == plain else None


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the bos/eos/pad conventions of its tokenizer_config.json.

    `encode` bypasses the backend's post-processor and adds bos itself, so bos appears exactly
    once whether or not tokenizer.json's post-processor also adds it.
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping[str, Any] | None = None,
                 path: Path | None = None, chat_template: str | None = None) -> None:
        """`chat_template` (a chat_template.jinja file's) wins over tokenizer_config.json's, as in transformers."""
        config = dict(config or {})
        self.backend = backend
        self.path = path
        where = path / CONFIG_FILE if path is not None else Path(CONFIG_FILE)
        self._bos_token_id = self._config_token_id(config, "bos_token", where)
        if "bos_token" not in config:  # as transformers, bos is then what tokenizer.json's post-processor adds
            self._bos_token_id = _post_processor_bos(backend)
        self._add_bos = bool(config.get("add_bos_token", self._bos_token_id is not None))
        self._eos_token_id = self._config_token_id(config, "eos_token", where)
        self._pad_token_id = self._config_token_id(config, "pad_token", where)
        marked = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        named = {self._bos_token_id, self._eos_token_id, self._pad_token_id} - {None}
        self.special_ids: frozenset[int] = frozenset(marked | named)
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.is_byte_level: bool = isinstance(backend.decoder, decoders.ByteLevel)
        self.chat_template: str | None = chat_template or _chat_template(config.get("chat_template"), where)

    def _config_token_id(self, config: Mapping[str, Any], field: str, where: Path) -> int | None:
        content = _token_content(config.get(field), field, where)
        if content is None:
            return None
        if (i := self.backend.token_to_id(content)) is None:
            raise ValueError(f"{where}: {field} {content!r} is not in the tokenizer's vocabulary")
        return i

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (required) and tokenizer_config.json (optional) from a checkpoint dir."""
        path = Path(path)
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"cannot read tokenizer file {file}: {e}") from e
        config: dict[str, Any] = {}
        if (cfg_file := path / CONFIG_FILE).is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError) as e:
                raise ValueError(f"cannot read {cfg_file}: {e}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{cfg_file}: expected a JSON object")
        template = None
        if (template_file := path / CHAT_TEMPLATE_FILE).is_file():
            try:
                template = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read {template_file}: {e}") from e
        return cls(backend, config, path, template)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    def adopt_eos(self, config_eos: int | None) -> str | None:
        """Take config.json's eos_token_id where tokenizer_config.json names no eos_token (generation would never end
        at an eos otherwise; transformers' generate stops there); a note saying so, or that the two differ (the
        tokenizer's is kept, as vLLM keeps it), for the loader to log."""
        if config_eos is None or config_eos == self._eos_token_id or not 0 <= config_eos < self.vocab_size:
            return None
        token = self.backend.id_to_token(config_eos)
        if self._eos_token_id is None:
            self._eos_token_id = config_eos
            self.special_ids = self.special_ids | {config_eos}
            return (f"{self.path}: tokenizer_config.json names no eos_token; generation ends at config.json's "
                    f"eos_token_id {config_eos} ({token!r})")
        return (f"{self.path}: tokenizer_config.json's eos_token ({self.backend.id_to_token(self._eos_token_id)!r}, "
                f"id {self._eos_token_id}) and config.json's eos_token_id {config_eos} ({token!r}) differ; generation "
                "ends at the tokenizer's")

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    def token_id(self, token: str) -> int | None:
        """Id of a token spelled as in the vocabulary (e.g. "<think>"), or None if absent."""
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; bos is prepended per add_bos_token unless `add_bos` overrides it,
        and not again when `text` already starts with the bos token (e.g. a rendered chat template)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self._add_bos if add_bos is None else add_bos:
            if self._bos_token_id is None:
                raise ValueError(f"cannot add bos: no bos_token in {self.path or 'the config'}")
            if not ids or ids[0] != self._bos_token_id:
                ids.insert(0, self._bos_token_id)
        return ids

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary's strings of `ids` (HF's convert_ids_to_tokens: byte-level pieces, not text)."""
        return [self.backend.id_to_token(i) for i in ids]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special_ids are dropped here (not by the backend) so that exactly the
        ids IncrementalDetokenizer skips are skipped, config-named ones included."""
        ids = [i for i in ids if not (skip_special_tokens and i in self.special_ids)]
        return self.backend.decode(ids, skip_special_tokens=False)

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece-style byte tokens (<0x00>..<0xFF>), built once."""
        return frozenset(i for t, i in self.backend.get_vocab(with_added_tokens=False).items()
                         if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))

    @cached_property
    def max_token_bytes(self) -> int:
        """Bytes of text the longest token stands for: n tokens never cover more than n times this."""
        if self.is_byte_level:
            return max(map(len, self.byte_table))
        return max(len(self.backend.decode([i], skip_special_tokens=False).encode("utf-8"))
                   for i in range(self.vocab_size))

    def max_text_bytes(self, tokens: int) -> int:
        """The most UTF-8 bytes `tokens` tokens can stand for: longer text cannot fit a context of `tokens` (a
        model's max_seq_len), and is refused before it is tokenized (request_validation.CONTEXT_BYTES says so)."""
        return tokens * self.max_token_bytes

    @cached_property
    def byte_table(self) -> tuple[bytes, ...]:
        """id -> the bytes the ByteLevel decoder turns that token into, built once.

        Mirrors tokenizers' ByteLevel decoder: a token whose characters are all in the byte
        alphabet maps to those bytes, any other token (e.g. "<｜end▁of▁sentence｜>") to its own
        UTF-8; ids the vocabulary lacks map to b"" since decode drops them too.
        """
        if not self.is_byte_level:
            raise ValueError(f"byte_table needs a ByteLevel decoder, got {type(self.backend.decoder).__name__}")
        table = _byte_decoder()
        out = []
        for i in range(self.vocab_size):
            token = self.backend.id_to_token(i)
            if token is None:
                out.append(b"")
            elif all(c in table for c in token):
                out.append(bytes(table[c] for c in token))
            else:
                out.append(token.encode("utf-8"))
        return tuple(out)


class IncrementalDetokenizer:
    """Streams the text of generated ids; the concatenation of all `push` results and `flush`
    equals `tokenizer.decode(all ids, skip_special_tokens)`.

    Byte-level tokenizers: token bytes go through an incremental UTF-8 decoder, which holds back
    an incomplete character until its last byte arrives and replaces bytes that can never become
    valid (errors="replace"), so each chunk is valid text and bad model output never raises.
    Other tokenizers (e.g. SentencePiece-style byte fallback): a sliding window of ids is
    re-decoded and text is held back while it ends in U+FFFD (vLLM's scheme), so the work per
    token is bounded by the window, which closes whenever text is emitted; and while the window
    ends in a byte token, since the byte-fallback decoder judges a run of byte tokens as a whole
    (a byte that decodes alone can become U+FFFD once its run turns out invalid).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._parts: list[str] = []
        if tokenizer.is_byte_level:
            self._table = tokenizer.byte_table
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self._ids: list[int] = []
            self._prefix = self._read = 0  # window start; ids[:_read] are already emitted

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    @property
    def holding(self) -> bool:
        """Whether ids pushed so far end inside a character (their text waits for the ids that complete it)."""
        if self._tok.is_byte_level:
            return self._utf8.getstate()[0] != b""
        return self._read < len(self._ids)

    def push(self, ids: Iterable[int]) -> str:
        """Feed newly generated ids; return the text they complete (possibly "")."""
        if self._tok.is_byte_level:
            n = len(self._table)
            data = b"".join(self._table[i] for i in ids if 0 <= i < n and i not in self._skip)
            return self._emit(self._utf8.decode(data))
        self._ids.extend(i for i in ids if i not in self._skip)
        if self._ids and self._ids[-1] in self._tok.byte_fallback_ids:  # a byte run counts once closed
            return ""
        prev, new = self._window()
        if len(new) <= len(prev) or new.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return self._emit(new[len(prev):])

    def flush(self) -> str:
        """End of stream: return held-back text, with U+FFFD for an incomplete final character."""
        if self._tok.is_byte_level:
            return self._emit(self._utf8.decode(b"", final=True))
        prev, new = self._window()
        self._prefix = self._read = len(self._ids)
        return self._emit(new[len(prev):])

    def _window(self) -> tuple[str, str]:
        decode = self._tok.backend.decode
        return (decode(self._ids[self._prefix:self._read], skip_special_tokens=False),
                decode(self._ids[self._prefix:], skip_special_tokens=False))

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text
