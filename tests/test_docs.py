"""The user's guide stays true: links resolve, README commands run, quoted measurements match their files.

- Every relative link in README.md, docs/*.md, triton_repo/README.md and the model card names a file or
  directory of the repository, and a `#anchor` into a Markdown file names one of its headings.
- Every command in README.md's shell code blocks is known: a console script of pyproject.toml or a
  `python -m` module of this project runs with `--help` (exit 0) and its help lists each `--flag` the README
  gives it; a few outside tools (curl, pip, ...) are let through by name; anything else fails. The two set-up
  commands (scripts/quickstart.sh, scripts/run_tests.sh) are not run: they are what CI runs.
- README.md's Python code blocks compile, and the names they import from this project exist.
- A README table row that links a result file under docs/benchmarks/ gives that file's recorded commit and
  date, and every decimal number and measured integer in the row is one of the file's numbers (as rounded in
  the row).
- Every decimal number and measured integer in a section of docs/*.md (a heading to the next) is one of the
  numbers of the result files the section links or names, or a setting that page's short list (SETTINGS) names;
  a section with such numbers and no result file fails. A paragraph (or list item) that links or names result files
  itself is held to those files alone, so a number quoted beside one file's link cannot come from another's. A measured integer is one written with thousands
  separators (28,029 requests) or one of 4+ digits next to a unit or a measured noun (1419 tok/s, 27034 served)
  or in a table row; it must be a file's number exactly, or to its last non-zero digit where the page marks it
  approximate (about 1,900, ~1,700). Smaller integers, years, dates, commits, versions, ids and ports are left
  alone: they are settings and names far more often than measurements, and a small count would match some other
  number of a file by chance anyway.

The helpers are tested on broken input too, so each check can fail.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys

from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks"
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "triton_repo" / "README.md",
         ROOT / "models" / "deepseek-v3-mini" / "README.md"]
SETUP_SCRIPTS = {"scripts/quickstart.sh", "scripts/run_tests.sh"}  # what CI runs; not run again here
# Outside tools a README block may show; they are not this project's to check.
EXTERNAL = {"cd", "cp", "curl", "docker", "export", "git", "mkdir", "pip", "source", ".", "sudo", "trtllm-serve",
            "genai-perf", "perf_analyzer", "aiperf", "apt-get", "cat", "echo", "head", "tail", "ls"}
PROJECT_PACKAGES = ("builder", "runtime", "serving", "benchmarks", "training")
HELP_TIMEOUT_S = 120
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))  # docs/benchmarks/*.md are generated, not checked here
# Decimal numbers on a docs page that are settings, versions or facts of upstream's release, not measurements:
# page -> number as printed -> why. A number a result file records (a benchmark's settings are in its command or
# settings) needs no entry; a measured number never gets one.
SETTINGS = {
    "engine-format.md": {"4.3": "the size of each of DeepSeek-V3's released shards, ~4.3 GB: the release's"},
    "gpu.md": {"8.9": "compute capability 8.9 (Ada), the first with FP8 products"},
    "openai-server.md": {"1.0": "temperature's default",
                         "1,000,000": "chat.MAX_RANGE_ITEMS and MAX_PRODUCT_ITEMS, a template render's bounds"},
    "parallel-execution.md": {"0.9": "--free_gpu_memory_fraction's default",
                              "0.12": "kv_b_proj's bytes a rank at tp 8, arithmetic on DeepSeek-V3's config.json"},
    "reliability.md": {"0.9": "free_memory_fraction's default"},
    "sampling-features.md": {"9999.0": "the logprob vLLM's OpenAI server writes for -inf",
                             "1024": "MAX_STOP_CHARS, the longest stop string a request may give",
                             "0.01": "REPETITION_PENALTY_RANGE's low end"},
    "speculative-decoding.md": {"1.1": "MIN_GAIN, the adaptive policy's margin"},
    "structured-output.md": {"0.2": "xgrammar's version"},
    "trtllm-backend.md": {"1.0": "TensorRT-LLM's version", "1.1": "TensorRT-LLM's version"},
}

FENCE = re.compile(r"^(```|~~~)\s*([\w+-]*)[^\n]*\n(.*?)^\1\s*$", re.M | re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
INLINE_CODE = re.compile(r"(`+).*?\1", re.S)


# ---- Markdown -----------------------------------------------------------------------------------

def code_blocks(text: str, languages: set[str]) -> list[str]:
    return [m.group(3) for m in FENCE.finditer(text) if m.group(2).lower() in languages]


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code (links there are examples, not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """Relative links of a Markdown file that name nothing in the repository (or no heading)."""
    text = path.read_text(encoding="utf-8") if text is None else text
    body = prose(text)
    targets = INLINE_LINK.findall(body) + REFERENCE_LINK.findall(body)
    broken = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        file_part = file_part.split("?")[0]
        dest = path if not file_part else (path.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    return broken


# ---- commands ------------------------------------------------------------------------------------

def console_scripts() -> set[str]:
    """The names under [project.scripts] of pyproject.toml (read by hand: tomllib is Python 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [project.scripts]"
    return set(re.findall(r"^\s*([\w.-]+)\s*=", section.group(1), re.M))


def shell_commands(block: str) -> list[list[str]]:
    """The simple commands of a shell block: lines joined at backslashes, comments dropped, split at
    `&&`, `||`, `;` and `|`, leading VAR=value assignments dropped. Heredoc bodies are skipped."""
    commands: list[list[str]] = []
    lines = block.replace("\\\n", " ").splitlines()
    heredoc_end: str | None = None
    for line in lines:
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        m = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if m:
            heredoc_end, line = m.group(1), line[:m.start()]
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if token in (";", "&&", "||", "|", "&"):
                commands.append(current)
                current = []
            elif token in ("<", ">", ">>", "(", ")"):
                current.append(token)
            else:
                current.append(token)
        commands.append(current)
    result = []
    for tokens in commands:
        while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
            tokens = tokens[1:]
        if tokens:
            result.append(tokens)
    return result


def program_of(tokens: list[str], scripts: set[str]) -> tuple[str, tuple[str, ...]] | None:
    """(name, argv for --help) of a project command; None for a command that needs no check here.
    ValueError for a command this test does not know."""
    program = tokens[0]
    if program in scripts:
        exe = Path(sys.executable).with_name(program)
        return program, (str(exe) if exe.exists() else shutil.which(program) or program,)
    if program in ("python", "python3") and len(tokens) > 2 and tokens[1] == "-m":
        module = tokens[2]
        if module.split(".")[0] in PROJECT_PACKAGES:
            return f"python -m {module}", (sys.executable, "-m", module)
        if module == "pip":
            return None
    if program in ("python", "python3") and len(tokens) > 1 and tokens[1] == "-c":
        return None
    if program == "bash" and len(tokens) > 1:
        if tokens[1] in SETUP_SCRIPTS:
            return None
        if not (ROOT / tokens[1]).is_file():
            raise ValueError(f"bash {tokens[1]}: no such script")
        return None
    if program in EXTERNAL:
        return None
    raise ValueError(f"{' '.join(tokens)}: {program!r} is neither a console script of pyproject.toml, a "
                     f"`python -m` module of this project, nor a known outside tool")


def flags_missing_from_help(tokens: list[str], help_text: str) -> list[str]:
    flags = [t.split("=")[0] for t in tokens[1:] if re.match(r"^--[A-Za-z]", t)]
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]


def readme_commands() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    return [c for block in code_blocks(text, {"bash", "sh", "shell", "console"}) for c in shell_commands(block)]


# ---- measurements --------------------------------------------------------------------------------

def numbers_in(value: object, integers: bool = False) -> list[float]:
    """The numbers of a record, and the decimal numbers inside its strings (a command's flags); with `integers`,
    the integers inside its strings and keys too (a shape named "o_proj 7168x16384 M=2048"), but no pid."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        # a process's pid is no measurement: under "pid", as a key of its own (shmem_kb's "9100") or in parentheses
        # in one ("stub tensorrt_llm_0_0 (9100)")
        keys = [x for k in value if not str(k).isdigit()
                for x in numbers_in(re.sub(r"\(\d+\)", "", str(k)), integers)] if integers else []
        if integers:
            value = {k: v for k, v in value.items() if k != "pid"}
        return keys + [x for v in value.values() for x in numbers_in(v, integers)]
    if isinstance(value, list):
        return [x for v in value for x in numbers_in(v, integers)]
    if isinstance(value, str):
        return [float(x) for x in re.findall(r"\d+\.\d+" if not integers else r"\d+(?:\.\d+)?", value)]
    return []


def measurement_text(text: str) -> str:
    """A piece of Markdown without what holds no measurement: code, link targets, addresses, versions, dates and
    commits."""
    versions = r"(\b(?:Triton|tritonserver|torch|Python|CUDA|transformers)`? )\d+(?:\.\d+)+"  # "Triton 2.51"
    text = re.sub(versions, r"\1", text)
    text = INLINE_CODE.sub(" ", FENCE.sub(" ", text))
    text = re.sub(r"\]\([^)]*\)", "] ", text)  # link targets; a link's text stays
    text = re.sub(r"<?https?://\S+", " ", text)
    # dates, and commits: 7 to 40 hex digits with a letter among them, or 7 digits (8651496); 33171952 is a number
    return re.sub(r"\b\d{4}-\d{2}-\d{2}\b|\b(?=\d*[a-f])[0-9a-f]{7,40}\b|\b\d{7}\b", " ", text)


def decimal_numbers(text: str) -> list[str]:
    """The decimal numbers of a piece of Markdown as printed, outside code, link targets, dates, commits and
    versions."""
    text = measurement_text(text)
    # a number ends at a space, punctuation, a sentence's full stop or a ratio's "x" (1.57x), not inside a
    # version (2.51.0) or a name (v1.2b)
    return re.findall(r"(?<![\w.])\d+\.\d+(?=x?(?:[^\w.]|\.(?!\w)|$))", text)


# A number recorded under a key that names its unit, in the units the pages print it in: bytes as KiB, MiB or GiB;
# kB (as /proc gives them) as MB (the soak's own tables divide by 1024).
UNIT_KEYS = ((re.compile(r"bytes"), (2 ** -10, 2 ** -20, 2 ** -30)), (re.compile(r"(?:^|_)kb(?:_|$)"), (2 ** -10,)))


def unit_numbers(value: object, scales: tuple[float, ...] = ()) -> list[float]:
    """The numbers of `value` that sit under a key naming their unit (or inside one), converted (UNIT_KEYS)."""
    if isinstance(value, dict):
        found = []
        for key, inner in value.items():
            inner_scales = next((s for pattern, s in UNIT_KEYS if pattern.search(str(key))), scales)
            found += unit_numbers(inner, inner_scales)
        return found
    if isinstance(value, list):
        return [x for v in value for x in unit_numbers(v, scales)]
    return [x * scale for x in numbers_in(value) for scale in scales] if scales else []


# Integers the pages print that are measurements: any written with thousands separators (28,029), and one of 4+
# digits followed by a unit or a measured noun (1419 tok/s, 27034 requests, a 1500-token prefix; also each number of a
# list that ends in one: 1095 and 1419 tok/s) or standing in a table row. Smaller integers are counts of settings and
# things (2 cores, 16 experts, k = 3) far more often than measurements, and a bare 4+ digit number in prose is an id,
# a port, a year or an issue number: neither is checked. The unit decides how a file's numbers may be scaled to it.
TIME_UNITS = r"ms|us|µs|ns"  # from seconds (x 1000) or as recorded
SIZE_UNITS = r"KB|KiB|kB|MB|MiB|GB|GiB|bytes|B"  # from bytes or kB (UNIT_KEYS) or as recorded
PLAIN_UNITS = (r"tok/s|tokens?/s|req/s|s|seconds?|minutes?|requests?|tokens?|cancels?|cancell?ed|cancellations?|"
               r"served|refused|refusals?|responses?|errors?|disconnect(?:s|ed)?|runs?|steps?|calls?|drafts?|"
               r"blocks?|positions?|parameters?|params|rows?|columns?|layers?")  # counts and rates: as recorded
YEAR = re.compile(r"^(?:19[5-9]\d|20[0-3]\d)$")
# "about 1,900", "~1,700": the number is rounded (to its last non-zero digit); any other is exact
APPROXIMATE = re.compile(r"(?:\b(?:about|around|roughly|nearly|almost|approximately|some)|~|≈)\s*$", re.I)


class Integer(NamedTuple):
    printed: str  # as on the page: "28,029"
    kind: str  # "time", "size" or "plain" (its unit's), "table" (a table cell's, unit unknown) or "count" (none)
    approximate: bool


def measured_integers(text: str) -> list[Integer]:
    """The measured integers of a piece of Markdown (as the comment above TIME_UNITS says), outside what
    measurement_text drops."""
    units = {"time": TIME_UNITS, "size": SIZE_UNITS, "plain": PLAIN_UNITS}
    # the numbers of a list that ends in a unit share it: "1095 and 1419 tok/s" (not "hidden 1024, 4 layers")
    list_of_numbers = r"(?:\s*(?:and|or|to|vs\.?|/|-|–)\s*~?\d[\d,.]*)*"
    found = []
    for line in measurement_text(text).splitlines():
        in_table = line.lstrip().startswith("|")
        # an integer ends at a space or punctuation, not inside a decimal (3.14), a version (2.51.0) or a name
        # (v12, TRTLLM-7028, 4096d)
        for m in re.finditer(r"(?<![\w.,-])(\d{1,3}(?:,\d{3})+|\d+)(?!\w|[.,]\d)", line):
            number, after = m.group(1), line[m.end():]
            digits = number.replace(",", "")
            kind = next((k for k, u in units.items() if re.match(rf"{list_of_numbers}[ -]?(?:{u})(?![\w/])", after)),
                        "table" if in_table else "count")
            if "," in number or (len(digits) >= 4 and not YEAR.match(digits) and kind != "count"):
                found.append(Integer(number, kind, bool(APPROXIMATE.search(line[:m.start()]))))
    return found


def integer_numbers(text: str) -> list[str]:
    """The measured integers of a piece of Markdown as printed."""
    return [i.printed for i in measured_integers(text)]


def is_integer_among(number: Integer, values: list[float]) -> bool:
    """`number` is one of `values` rounded to an integer; an approximate one (about 7,600) rounded as printed: to its
    last non-zero digit, never to fewer than two significant digits (7,550 to 7,649; about 10,000: 9,500 to 10,499)."""
    digits = number.printed.replace(",", "")
    zeros = min(len(digits) - len(digits.rstrip("0")), len(digits) - 2) if number.approximate else 0
    tolerance = 0.5 * 10 ** max(zeros, 0) + 1e-9
    return any(abs(v - int(digits)) <= tolerance for v in values)


def integer_values(paths: list[Path], kind: str) -> list[float]:
    """The numbers of result files an integer of `kind` may print: as recorded, with the integers inside recorded
    strings and keys (a command's --max_tokens 2048, a shape named "o_proj 7168x16384"); seconds as ms for a time
    or a table cell; bytes and kB as the pages print them (UNIT_KEYS) for a size or a table cell."""
    values = []
    for path in paths:
        record = json.loads(path.read_text())
        raw = numbers_in(record, integers=True)
        values += raw
        if kind in ("time", "table"):
            values += [x * 1000 for x in raw]
        if kind in ("size", "table"):
            values += unit_numbers(record)
    return values


def file_values(paths: list[Path]) -> list[float]:
    """The numbers of result files as recorded, or in the units a reader wants: seconds as ms, fractions as
    percent, bytes and kB as the pages print them (UNIT_KEYS)."""
    values = []
    for path in paths:
        record = json.loads(path.read_text())
        values += [x * scale for x in numbers_in(record) for scale in (1, 1000, 100)] + unit_numbers(record)
    return values


def is_among(number: str, values: list[float]) -> bool:
    """`number` as printed is one of `values`, rounded to the number's decimals (a page prints a negative value's
    sign apart: -0.6%)."""
    tolerance = 0.5 * 10 ** -len(number.split(".")[1]) + 1e-9
    return any(abs(abs(v) - float(number)) <= tolerance for v in values)


def row_problems(row: str) -> list[str]:
    """A table row quoting a result file: its commit and date are in the row, and each decimal number in the
    row (outside links and code) is a number of the file, as rounded."""
    files = sorted(set(re.findall(r"\((docs/benchmarks/[\w.-]+\.json)\)", row)))
    if len(files) != 1:
        return [f"row links {len(files)} result files (give one per row): {row[:80]}"]
    record = json.loads((ROOT / files[0]).read_text())
    machine = record["machine"]
    problems = []
    commit, date = machine["git_commit"][:7], machine["date_utc"][:10]
    if commit not in row:
        problems.append(f"{files[0]}: commit {commit} not in the row")
    if date not in row:
        problems.append(f"{files[0]}: date {date} not in the row")
    text = re.sub(r"\[[^\]]*\]\([^)]*\)", " ", row)  # drop links (text too), not parentheses
    for number in numbers_missing(text, [ROOT / files[0]]):
        problems.append(f"{files[0]}: {number} is not among the file's numbers")
    return problems


def numbers_missing(text: str, files: list[Path], allowed: dict[str, str] | None = None) -> list[str]:
    """The decimal numbers and measured integers of a piece of Markdown, as printed, that are none of the files'
    numbers (as rounded) nor allowed."""
    allowed = allowed or {}
    decimals = [n for n in decimal_numbers(text) if n not in allowed]
    integers = [i for i in measured_integers(text) if i.printed not in allowed]
    values = file_values(files) if decimals else []
    by_kind = {kind: integer_values(files, kind) for kind in {i.kind for i in integers}}
    return [n for n in decimals if not is_among(n, values)] + \
        [i.printed for i in integers if not is_integer_among(i, by_kind[i.kind])]


def result_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|") and "docs/benchmarks/" in line
            and ".json)" in line]


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, text) of each section of a page: a heading to the next heading of any level, the heading's line
    included (the text before the first heading is the page's own, under ""). Lines in fenced blocks are not
    headings."""
    found: list[tuple[str, list[str]]] = [("", [])]
    fence: str | None = None
    for line in text.splitlines():
        m = re.match(r"^(```|~~~)", line)
        if m:
            fence = None if fence == m.group(1) else fence or m.group(1)
        heading = None if fence or m else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            found.append((heading.group(1), []))
        found[-1][1].append(line)
    return [(heading, "\n".join(lines)) for heading, lines in found]


def paragraphs(text: str) -> list[str]:
    """The paragraphs of a piece of Markdown: split at blank lines and at each list item; a fenced block stays
    whole, inside the paragraph it is in."""
    found: list[list[str]] = [[]]
    fence: str | None = None
    for line in text.splitlines():
        m = re.match(r"^\s*(```|~~~)", line)
        if m:
            fence = None if fence == m.group(1) else fence or m.group(1)
        elif not fence and (not line.strip() or re.match(r"^\s{0,3}(?:[-*+]|\d+\.)\s", line)):
            found.append([])
            if not line.strip():
                continue
        found[-1].append(line)
    return ["\n".join(lines) for lines in found if lines]


def result_files(text: str) -> list[Path]:
    """The result files a piece of Markdown links or names, in code or not: `benchmarks/X.md`, `.json` or `.png` for
    docs/benchmarks/X.json (`benchmarks/soak_kinds/X.md` for docs/benchmarks/soak_kinds/X.json), and every result
    file of a folder of them it names (`benchmarks/soak_kinds.md`, `benchmarks/soak_kinds/`)."""
    files: set[Path] = set()
    for name in re.findall(r"benchmarks/((?:[\w-]+/)*[\w.-]+?)(?:\.(?:md|json|png)\b|/)", text):
        if (BENCHMARKS / f"{name}.json").is_file():
            files.add(BENCHMARKS / f"{name}.json")
        if (BENCHMARKS / name).is_dir():
            files.update((BENCHMARKS / name).glob("*.json"))
    return sorted(files)


def section_problems(page: str, text: str, allowed: dict[str, str] | None = None) -> list[str]:
    """Each decimal number and measured integer (integer_numbers) of each section of a docs page is a number of a
    result file the section links or names (as rounded), or a setting the page's allow-list names."""
    allowed = allowed or {}
    problems = []
    for heading, body in sections(text):
        numbers = [n for n in decimal_numbers(body) + integer_numbers(body) if n not in allowed]
        if not numbers:
            continue
        files = result_files(body)
        where = f"{page}, section {heading or '(top)'!r}"
        if not files:
            problems.append(f"{where}: {', '.join(numbers)} quote no result file (link one)")
            continue
        # a paragraph that links result files is held to them; the others to the section's
        own = [(para, result_files(para)) for para in paragraphs(body)]
        rest = "\n\n".join(para for para, para_files in own if not para_files)
        for text, text_files in [(rest, files), *((para, f) for para, f in own if f)]:
            missing = numbers_missing(text, text_files, allowed)
            if missing:
                names = ", ".join(str(f.relative_to(BENCHMARKS)) for f in text_files)
                problems.append(f"{where}: {', '.join(missing)} not among the numbers of {names}")
    return problems


# ---- the tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert page.is_file(), page
    assert broken_links(page) == []


def test_readme_commands_are_known_and_run_with_help() -> None:
    scripts = console_scripts()
    commands = readme_commands()
    assert commands, "no shell commands found in README.md"
    programs: dict[str, tuple[str, ...]] = {}
    uses: list[tuple[str, list[str]]] = []
    errors = []
    for tokens in commands:
        try:
            found = program_of(tokens, scripts)
        except ValueError as e:
            errors.append(str(e))
            continue
        if found:
            programs[found[0]] = found[1]
            uses.append((found[0], tokens))
    assert not errors, "\n".join(errors)
    assert programs, "README.md shows no command of this project"
    # All --help runs at once: most of their time is importing torch.
    procs = {name: subprocess.Popen([*argv, "--help"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, argv in programs.items()}
    helps = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=HELP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            errors.append(f"{name} --help did not finish in {HELP_TIMEOUT_S} s")
            continue
        if proc.returncode != 0:
            errors.append(f"{name} --help exited {proc.returncode}:\n{out[-2000:]}")
        helps[name] = out
    for name, tokens in uses:
        if name in helps:
            missing = flags_missing_from_help(tokens[1:] if name.startswith("python -m") else tokens, helps[name])
            if missing:
                errors.append(f"`{' '.join(tokens)}`: {name} --help lists no {', '.join(missing)}")
    assert not errors, "\n".join(errors)


def test_readme_python_blocks_compile_and_their_imports_exist() -> None:
    blocks = code_blocks(README.read_text(encoding="utf-8"), {"python", "py"})
    assert blocks, "README.md has no Python example"
    for block in blocks:
        tree = ast.parse(block)  # a SyntaxError fails the test
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT_PACKAGES:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"from {node.module} import {alias.name}: no such name"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PROJECT_PACKAGES:
                        importlib.import_module(alias.name)


def test_readme_measurements_match_their_result_files() -> None:
    rows = result_rows(README.read_text(encoding="utf-8"))
    assert rows, "README.md quotes no result file of docs/benchmarks/"
    problems = [p for row in rows for p in row_problems(row)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_measurements_match_the_result_files_their_sections_name(page: Path) -> None:
    problems = section_problems(page.name, page.read_text(encoding="utf-8"), SETTINGS.get(page.name))
    assert not problems, "\n".join(problems)


def test_each_allowed_setting_is_on_its_page() -> None:
    def printed(text: str) -> list[str]:
        return decimal_numbers(text) + integer_numbers(text)

    stale = [f"{page}: {number}" for page, numbers in SETTINGS.items() for number in numbers
             if number not in printed((ROOT / "docs" / page).read_text(encoding="utf-8"))]
    assert not stale, f"allowed settings no longer on their pages (drop them from SETTINGS): {stale}"


# ---- the checks can fail ---------------------------------------------------------------------------

def test_link_check_finds_broken_links() -> None:
    text = ("[ok](docs/engine-format.md) [gone](docs/no-such-page.md) [bad anchor](README.md#no-such-heading)\n"
            "[web](https://example.com) `[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n")
    assert broken_links(README, text) == ["docs/no-such-page.md (no such file)",
                                          "README.md#no-such-heading (no heading #no-such-heading in README.md)"]


def test_command_checks_find_unknown_commands_and_flags() -> None:
    scripts = console_scripts()
    [cmd] = shell_commands("build_engine --model_dir m \\\n  --no_such_flag 3   # comment\n")
    assert cmd == ["build_engine", "--model_dir", "m", "--no_such_flag", "3"]
    assert flags_missing_from_help(cmd, "usage: build_engine [--model_dir MODEL_DIR]") == ["--no_such_flag"]
    with pytest.raises(ValueError, match="neither a console script"):
        program_of(["build_engin", "--help"], scripts)
    assert program_of(["bash", "scripts/quickstart.sh"], scripts) is None
    with pytest.raises(ValueError, match="no such script"):
        program_of(["bash", "scripts/no_such.sh"], scripts)
    assert [c[0] for c in shell_commands(". .venv/bin/activate && dsv3-serve x | head; curl y")] == \
        [".", "dsv3-serve", "head", "curl"]


def test_measurement_check_finds_numbers_not_in_the_file() -> None:
    record = json.loads((ROOT / "docs/benchmarks/speculative.json").read_text())["machine"]
    good = f"| k=0 | 39.711 | [file](docs/benchmarks/speculative.json) | {record['git_commit'][:7]}, " \
           f"{record['date_utc'][:10]} |"
    assert row_problems(good) == []
    bad = good.replace("39.711", "39.987").replace(record["git_commit"][:7], "0000000")
    assert len(row_problems(bad)) == 2
    assert len(row_problems(good.replace("39.711", "39.711 (39.987 another way)"))) == 1  # parentheses count too
    soak = json.loads((ROOT / "docs/benchmarks/soak.json").read_text())["machine"]
    counts = f"| soak | 27034 requests, 18308 served | [file](docs/benchmarks/soak.json) | {soak['git_commit'][:7]}, " \
             f"{soak['date_utc'][:10]} |"
    assert row_problems(counts) == []
    assert row_problems(counts.replace("18308", "18380")) == \
        ["docs/benchmarks/soak.json: 18380 is not among the file's numbers"]


def test_integer_check_finds_counts_not_in_the_files() -> None:
    good = ("## Soak\n\n28,029 requests, 21,064 served, 5,662 refused, 1,303 cancelled, 1802 s "
            "([soak_no_bls_cancels.md](benchmarks/soak_no_bls_cancels.md)).\n")
    assert section_problems("p.md", good) == []
    assert section_problems("p.md", good.replace("1,303", "1,330")) == \
        ["p.md, section 'Soak': 1,330 not among the numbers of soak_no_bls_cancels.json"]
    # another file's count does not do (27,034 is soak.json's), nor a count with no file at all
    assert section_problems("p.md", good.replace("28,029", "27,034")) == \
        ["p.md, section 'Soak': 27,034 not among the numbers of soak_no_bls_cancels.json"]
    assert section_problems("p.md", "## S\n\n| jemalloc | 3,964 |\n") == \
        ["p.md, section 'S': 3,964 quote no result file (link one)"]
    # which integers are measurements: separated thousands, 4+ digits before a unit or noun (also the first of a
    # list that ends in one) or in a table; not small counts, ids, ports, years, dates, commits or code
    assert integer_numbers("2 cores, 16 experts, port 8000, issue 7006, PR 6948, TRTLLM-7028, in 2026, on "
                           "2026-11-26, commit 8651496, `1419 tok/s`, hidden 1024, 4 layers, 3.5 ms, 2.51.0; "
                           "1095 and 1419 tok/s, a 1500-token prefix, 28,029 requests, 2048 us") == \
        ["1095", "1419", "1500", "28,029", "2048"]
    assert integer_numbers("| o_proj | 1050 | 2026 | 12 | 33171952 | 4109438 |") == ["1050", "33171952"]
    # exact unless the page marks it approximate, then to its last non-zero digit (two significant digits at least)
    assert [i.approximate for i in measured_integers("about 1,900 requests, ~1,700 cancels, 1,303 cancelled")] == \
        [True, True, False]
    assert not is_integer_among(Integer("7,600", "plain", False), [7644.0])
    assert is_integer_among(Integer("7,600", "plain", True), [7644.0])
    assert not is_integer_among(Integer("7,600", "plain", True), [7660.0])
    assert is_integer_among(Integer("10,000", "plain", True), [10499.0])
    # a time may be a file's seconds as ms, a count only what the file counts; pids are not counts
    soak = [BENCHMARKS / "soak.json"]  # latency.all.latency_p50_s 2.0319884...
    assert is_integer_among(Integer("2032", "time", False), integer_values(soak, "time"))
    assert not is_integer_among(Integer("2032", "plain", False), integer_values(soak, "plain"))
    assert 9100 not in integer_values([BENCHMARKS / "soak_kinds" / "91e8e07_grpc_cancels_only.json"], "plain")
    # the integers in a result file's keys and strings count: fp8_h200's shapes and its command's flags
    assert {7168, 16384, 2048} <= set(integer_values([BENCHMARKS / "fp8_h200.json"], "plain"))


def test_section_check_finds_numbers_not_in_the_sections_files() -> None:
    good = "# Page\n\n## Measured\n\nk = 0: 39.711 ms ([speculative.md](benchmarks/speculative.md)).\n"
    assert section_problems("p.md", good) == []
    assert section_problems("p.md", good.replace("39.711", "39.987")) == \
        ["p.md, section 'Measured': 39.987 not among the numbers of speculative.json"]
    # a paragraph (or list item) linking a file is held to it, not to another file the section links
    two = ("## M\n\n[soak.md](benchmarks/soak.md) 27,034 requests.\n\n"
           "- k = 0: 39.711 ms ([speculative.md](benchmarks/speculative.md)).\n- 39.711 ms again.\n")
    assert section_problems("p.md", two) == []
    assert section_problems("p.md", two.replace("k = 0: 39.711", "k = 0: 39.711, 27,034 requests")) == \
        ["p.md, section 'M': 27,034 not among the numbers of speculative.json"]
    assert [p[:3] for p in paragraphs("a\nb\n\n- c\n- d\n```\n- e\n\nf\n```\n")] == ["a\nb", "- c", "- d"]
    # a file linked in another section does not count; a section with no file names its numbers
    apart = "## Files\n\n[speculative.md](benchmarks/speculative.md)\n\n## Numbers\n\n39.711 ms, 1.57x.\n"
    assert section_problems("p.md", apart) == ["p.md, section 'Numbers': 39.711, 1.57 quote no result file (link one)"]
    # code, link targets, versions, dates and allowed settings are not measurements; a ratio's "x" and a
    # sentence's full stop end a number
    quiet = "## S\n\n`0.5` [a](x/1.5.md) torch 2.11, `tritonserver` 2.51.0, 2026-11-26, default 0.9\n"
    assert section_problems("p.md", quiet, {"0.9": "a default"}) == []
    assert decimal_numbers("1.57x and 3.5. v1.2b 2.51.0") == ["1.57", "3.5"]
    # headings in code blocks do not start sections; a heading belongs to its section
    assert [h for h, _ in sections("# A\n```\n# not a heading\n```\n## B [f](benchmarks/x.md)\n")] == \
        ["", "A", "B [f](benchmarks/x.md)"]
    # every form of naming a result file; a folder's name stands for its files; a missing file for none
    assert result_files("`docs/benchmarks/soak.json`, benchmarks/fp8_h200.png, benchmarks/no_such.md") == \
        [BENCHMARKS / "fp8_h200.json", BENCHMARKS / "soak.json"]
    assert result_files("`docs/benchmarks/soak_kinds/c78e791_no_bls_cancels.md`") == \
        [BENCHMARKS / "soak_kinds" / "c78e791_no_bls_cancels.json"]
    assert result_files("[soak_kinds/](benchmarks/soak_kinds.md)") == sorted((BENCHMARKS / "soak_kinds").glob("*.json"))
    # recorded units: bytes as MiB, kB as MB
    assert is_among("107.0", file_values([BENCHMARKS / "fp8_h200.json"]))  # fp32 weight_bytes 112239840
    assert is_among("101.6", file_values([BENCHMARKS / "soak_kinds" / "100082b_no_bls_cancels.json"]))  # start_kb 104064
