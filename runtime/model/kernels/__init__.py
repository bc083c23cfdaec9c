"""The native runtime's CPU kernels (`cpu_kernels.cpp`), compiled on first use and cached.

On CPU a decode step in ATen is dominated by per-operation overhead and by streaming fp32 weights,
so the serving path runs C++ with AVX-512 instead: linear layers whose weights stay in the release's
FP8 (or BF16) form, a whole MoE layer per call, absorbed MLA in two calls over the paged latent
cache, RMSNorm; and composed of these, a whole decoder layer, all of a model's layers, the MTP module,
its greedy chain of drafts and a whole greedy step (speculative or plain), each in one call. Without AVX-512 (or a
compiler) the runtime uses its PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import grp
import hashlib
import logging
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor

from runtime.model.config import ModelConfig
from runtime.model.fp8 import scale_shape

if TYPE_CHECKING:
    from runtime.model.batch import PagedBatch

log = logging.getLogger(__name__)

EXTENSION = "dsv3_cpu_kernels"
SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512f"]
PANEL = 16  # weight rows per packed panel (one AVX-512 register of outputs)
MAX_EXPERTS, MAX_GROUPS = 256, 64  # the routing kernel's limits (DeepSeek-V3: 256 experts in 8 groups)
FP8_TO_HALF = 256.0  # the kernel reads e4m3 bytes as fp16 values 2^8 times too small


def cpu_missing_flags() -> list[str]:
    """CPU features the kernels need that this machine lacks (all of them off x86-64 Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(CPU_FLAGS)
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return [f for f in CPU_FLAGS if f not in flags]


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None (with one warning saying why) where it cannot run here."""
    missing = cpu_missing_flags()
    if missing:
        log.warning("CPU kernels off: this CPU lacks %s; using the PyTorch path", ", ".join(missing))
        return None
    from torch.utils.cpp_extension import load

    build = build_dir()
    try:
        build.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(build)
    except OSError as e:
        log.warning("CPU kernels off: %s; using the PyTorch path", e)
        return None
    try:
        with _sole_builder(build):
            return load(EXTENSION, [str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(build),
                        verbose=os.environ.get("DSV3_KERNELS_VERBOSE") == "1")
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, failed build
        log.warning("CPU kernels off: building %s failed (%s); using the PyTorch path", SOURCE.name, e)
        return None


def build_dir() -> Path:
    """Where the extension is built, once, into torch's extension cache (TORCH_EXTENSIONS_DIR), rebuilt when the
    source changes: one directory per source path, since ninja rebuilds whenever the path in its command changes
    (two checkouts sharing one directory would rebuild in turn, each waiting for the other's build)."""
    checkout = hashlib.sha1(str(SOURCE.resolve()).encode()).hexdigest()[:8]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return root / f"{EXTENSION}_py{sys.version_info.major}{sys.version_info.minor}_{checkout}"


def check_private(build: Path) -> None:
    """OSError unless no other user can change what this process loads and runs: the build directory and every
    directory above it (symlinks resolved) are this user's or root's, and no other user can write to them (a
    sticky directory, as /tmp is, lets no one rename what is not theirs; a group of this user alone, as a umask
    of 002 under per-user groups gives, is no other user). A TORCH_EXTENSIONS_DIR in a shared directory could be
    made, or renamed away and replaced, by another user, who would then have this process load a library of
    theirs."""
    real = build.resolve()
    for path in (real, *real.parents):
        st = os.stat(path)
        if st.st_uid not in (os.getuid(), 0) or _writable_by_others(st, sticky_protects=path != real):
            raise OSError(f"{path} is not private to uid {os.getuid()} (owner uid {st.st_uid}, group {st.st_gid}, "
                          f"mode {stat.S_IMODE(st.st_mode):o}): choose a TORCH_EXTENSIONS_DIR no other user can change")


def _writable_by_others(st: os.stat_result, sticky_protects: bool) -> bool:
    """Another user can change what the directory holds; sticky_protects: a directory above the build directory,
    where the sticky bit keeps others from renaming ours (in the build directory itself they could still add the
    library before it is built)."""
    if sticky_protects and st.st_mode & stat.S_ISVTX:
        return False
    if st.st_mode & stat.S_IWOTH:
        return True
    if not st.st_mode & stat.S_IWGRP:
        return False
    try:
        return st.st_gid != os.getgid() or bool(grp.getgrgid(st.st_gid).gr_mem)
    except KeyError:  # a group without an entry: of no other user by name
        return False


@contextlib.contextmanager
def _sole_builder(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the build directory while torch loads (and perhaps builds) the extension.
    torch's own lock is a file that a killed build leaves behind, after which every later load waits for
    ever without a word (a server that never finishes starting). Whoever holds this lock is the only process
    in `load`, so a torch lock file found then is stale and is removed."""
    with open(os.open(build_dir / "dsv3.flock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("CPU kernels: waiting for another process that is building them in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("CPU kernels: removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


@dataclass
class PackedWeight:
    """A weight [N, K] (or experts stacked [E, N, K]) in panels [(E,) ceil(N/16), K, 16] of e4m3 bytes
    (uint8) or bfloat16, with scales per 128x128 block [(E,) ceil(N/128), ceil(K/128)] (FP8: the
    release's scales times 2^8 for the kernel; BF16: ones)."""

    panels: Tensor
    scale: Tensor
    out_features: int
    in_features: int

    @classmethod
    def empty_fp8(cls, experts: int, out_features: int, in_features: int) -> "PackedWeight":
        """Room for `experts` stacked FP8 matrices, filled one by one with `pack_fp8_into` as they stream in."""
        rows = -(-out_features // PANEL)
        return cls(torch.zeros(experts, rows, in_features, PANEL, dtype=torch.uint8),
                   torch.zeros(experts, *scale_shape((out_features, in_features))), out_features, in_features)


def _panels(m: Tensor, dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """[N, K] -> panels [ceil(N/16), K, 16] (into `out` when given), rows past N zero; converted to `dtype` panel
    by panel, so no whole-size temporary is made."""
    N, K = m.shape
    if out is None:
        out = torch.zeros(-(-N // PANEL), K, PANEL, dtype=dtype or m.dtype)
    for i in range(0, N, 8 * PANEL):  # a few panels at a time
        rows = m[i : i + 8 * PANEL]
        full, tail = divmod(rows.shape[0], PANEL)
        first = i // PANEL
        out[first : first + full] = rows[: full * PANEL].view(full, PANEL, K).transpose(1, 2)
        if tail:
            out[first + full, :, :tail] = rows[full * PANEL :].t()
    return out


def block_scales(scale: Tensor, shape: tuple[int, int]) -> Tensor:
    """A weight's FP8 scale as one per 128x128 block: block scales as they are, a per-tensor scale repeated."""
    grid = scale_shape(shape)
    return scale.float().reshape(grid) if scale.numel() > 1 else scale.float().reshape(1, 1).expand(grid)


def pack_fp8(codes: Tensor, scale: Tensor) -> PackedWeight:
    """FP8 codes [N, K] (float8_e4m3fn, as the release stores them) and their scale (per 128x128 block, or one
    for the tensor): packed as they are, nothing converted or rounded."""
    N, K = codes.shape
    return PackedWeight(_panels(codes.view(torch.uint8)), block_scales(scale, (N, K)) * FP8_TO_HALF, N, K)


def pack_fp8_into(packed: PackedWeight, expert: int, codes: Tensor, scale: Tensor) -> None:
    """One expert's codes and scale into a stacked `PackedWeight.empty_fp8`."""
    _panels(codes.view(torch.uint8), out=packed.panels[expert])
    packed.scale[expert] = block_scales(scale, tuple(codes.shape)) * FP8_TO_HALF


def pack_bf16(w: Tensor) -> PackedWeight | None:
    """Pack a [N, K] weight whose values are all BF16 (a release's unquantized weights); else None."""
    if w.dim() != 2 or not all(torch.equal(rows.bfloat16().to(w.dtype), rows) for rows in w.split(8 * PANEL)):
        return None
    return PackedWeight(_panels(w, torch.bfloat16), torch.ones(scale_shape(w.shape)), *w.shape)


def packed_linear(x: Tensor, w: PackedWeight) -> Tensor:
    """x [..., K] float32 -> [..., N]."""
    flat = x.reshape(-1, w.in_features).contiguous()
    return cpu_kernels().packed_linear(flat, w.panels, w.scale, w.out_features).view(*x.shape[:-1], w.out_features)


def moe(x: Tensor, gate: Tensor, bias: Tensor, cfg: ModelConfig, weights: tuple[Tensor, ...],
        first_expert: int = 0) -> Tensor:
    """A whole MoE layer for tokens x [T, H]: noaux_tc routing (router weight gate [E, H], bias [E]),
    routed experts, shared expert; `weights` the panels and scales of the routed experts' gate, up and down
    projections, then the shared expert's. With expert parallelism the routed panels hold this rank's experts
    only, first_expert.. of E; pairs routed elsewhere are skipped."""
    return cpu_kernels().moe(x.contiguous(), gate, bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
                             cfg.norm_topk_prob, cfg.routed_scaling_factor, *weights, first_expert)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return cpu_kernels().rms_norm(rows, weight, eps).view(x.shape)


def _pairs(rot: Tensor) -> Tensor:
    """Complex rotations [..., rope/2] as the kernels read them: float pairs [..., rope/2, 2]."""
    return torch.view_as_real(rot.contiguous())


def mla_prepare(q: Tensor, kv: Tensor, rot: Tensor, kv_norm: Tensor, eps: float, w_uk: Tensor, scale: float,
                cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """q [T, h*(nope+rope)], kv [T, rank+rope] (projections), rot complex [T, rope/2]: writes the normalized,
    roped latents to their cache slots; returns the absorbed queries [T, h, rank+rope], scaled."""
    return cpu_kernels().mla_prepare(q.contiguous(), kv, _pairs(rot), kv_norm, eps, w_uk, scale, cache,
                                     slot_mapping.contiguous())


def mla_attention(q: Tensor, cache: Tensor, positions: Tensor, token_seq: Tensor, block_tables: Tensor,
                  block_size: int, w_uv: Tensor) -> Tensor:
    """Absorbed queries [T, h, rank+rope] against each token's own sequence in the paged cache; returns the
    heads' outputs [T, h*v] (w_uv [h, rank, v])."""
    return cpu_kernels().mla_attention(q, cache, positions.contiguous(), token_seq.contiguous(), block_tables, block_size,
                                       w_uv)


def _paged(batch: PagedBatch) -> tuple:
    """The paged batch as the fused kernels take it, after the step's tensors."""
    return batch.slot_mapping, batch.positions, batch.token_seq, batch.block_tables, batch.block_size


def decoder_layer(layer: object, x: Tensor, rot: Tensor, kv_cache: Tensor, batch: PagedBatch) -> Tensor:
    """A whole decoder layer (`layer` from `make_layer`) over tokens x [T, H] in one call: the kernels above in
    DecoderLayer's order, so the result is bit for bit that of calling them one by one, without the Python in
    between (which on a small model costs as much as the kernels). rot: complex [T, rope/2]."""
    return cpu_kernels().decoder_layer(layer, x.contiguous(), _pairs(rot), kv_cache, *_paged(batch))


def decoder_layers(stack: object, x: Tensor, rot: Tensor, kv_cache: Tensor, batch: PagedBatch) -> Tensor:
    """All of a model's decoder layers (`stack` from `stack_layers`) in one call: `decoder_layer` for each in
    turn, without a Python call per layer."""
    return cpu_kernels().decoder_layers(stack, x.contiguous(), _pairs(rot), kv_cache,
                                        *_paged(batch))


def mtp_layer(mtp: object, ids: Tensor, hidden: Tensor, rot: Tensor, kv_cache: Tensor, batch: PagedBatch,
              rows: Tensor | None) -> tuple[Tensor, Tensor]:
    """A whole MTP module (`mtp` from `make_mtp`) in one call, bit for bit MTPLayer's kernels one by one:
    (logits, hidden after shared_head.norm), at `rows` only when given."""
    return cpu_kernels().mtp_layer(mtp, ids, hidden, _pairs(rot), kv_cache, *_paged(batch), rows)


def mtp_greedy_drafts(mtp: object, ids: Tensor, hidden: Tensor, rot: Tensor, kv_cache: Tensor, batch: PagedBatch,
                      draft_positions: Tensor, draft_rot: Tensor) -> Tensor:
    """Greedy drafts [B, K] in one call: `mtp_layer` over the catch-up (head at each sequence's last token), its
    argmax, then K - 1 more steps on its own drafts at draft_positions [K - 1, B] (rotations draft_rot, complex)."""
    return cpu_kernels().mtp_greedy_drafts(mtp, ids, hidden, _pairs(rot), kv_cache, *_paged(batch),
                                           batch.last_index, draft_positions, _pairs(draft_rot), [], None)


def greedy_step(target: object, mtp: object | None, ids: Tensor, hidden: Tensor, kv_cache: Tensor,
                tables: list[list[int]], block_size: int, num_mtp: list[int], num_cached: list[int], last_ids: list[int],
                num_drafts: list[int], adjustments: tuple | None = None,
                logprobs: tuple[list[int], list[bool]] | None = None) -> tuple[list[list[int]], Tensor, Tensor]:
    """A greedy step in one call (`target` from `make_target`), from host integers, sequence b drafting num_drafts[b]
    tokens: `mtp_greedy_drafts` over the catch-up of the sequences that draft (ids, hidden at positions num_mtp[b] ..
    num_cached[b] - 1 of sequence b, whose blocks are tables[b]), the target over each sequence's [last_ids[b], drafts]
    at positions num_cached[b] .., greedy acceptance. A sequence with no drafts is plain decoding; where none drafts,
    no MTP module is needed (`mtp` may be None; ids, hidden and num_mtp are not read). With `adjustments` (logit
    biases, penalties and bans in `adjust_logits`' layout: sampling.Adjustments.kernel_args, stop bans counted from the
    first draft's row) every draft and verified row is the argmax of its adjusted logits. With `logprobs` (per
    sequence: top-n, -1 for none; whether processed, i.e. of the adjusted logits), the emitted tokens' logprobs too, as
    `token_logprobs` of the rows that decided them. Returns the emitted tokens of each sequence, the target's hidden
    states after the final norm (num_drafts[b] + 1 rows per sequence, in order) and the logprob rows
    (`sampling.read_token_logprobs`; [0, 3] without `logprobs`)."""
    ext = cpu_kernels()
    adjust = None if adjustments is None else ext.Adjustments(*adjustments)
    top_n, processed = logprobs if logprobs is not None else ([], [])
    return ext.greedy_step(target, mtp, ids, hidden, kv_cache, tables, block_size, num_mtp, num_cached, last_ids,
                           num_drafts, adjust, top_n, processed)
