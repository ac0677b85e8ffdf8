"""ctypes bindings of the CPU C kernels (``csrc/*.c``, built by :mod:`.build`): one method per
kernel, taking torch tensors and checking only what its docstring says. Get an instance with
:func:`splitserve.engine.kernels.cpu.build.load_cpu_kernels`.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from splitserve.engine.kernels.cpu.pool_bindings import PoolKernels

log = logging.getLogger(__name__)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# Rows up to which linear_skinny beats oneDNN here (one core, SmolLM2's shapes, weights from
# memory): 1.8x at 1 row, 2x at 2, ~1.1x at 3, slower at 4 (oneDNN's bf16 kernel wins as
# soon as the product is compute- rather than memory-bound). Also the fused decode path's rows.
SKINNY_MAX_ROWS = 3
# Rows up to which the AVX512_BF16 tiles (gemm_bf16.c) beat oneDNN here (bench/cpu_gemm.py, one
# thread, weights from memory: 1.7-2x at 4-8 rows, 1.24x at 32, 1.05x at 128, even at 256).
GEMM_MAX_ROWS = 128
# Key positions per tile of the K layout the decode kernels read and the KV append writes
# (KT_TILE in csrc/kernels.h): per slot and KV head, [cap / KT_TILE, D, KT_TILE].
KT_TILE = 32


class CpuKernels(PoolKernels):
    """The loaded library. Every method takes contiguous CPU tensors and checks nothing that
    its docstring does not say: callers own the shapes. The kernels that write pool pages
    (KV append, fused decode layers) are in :class:`.pool_bindings.PoolKernels`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._attn = lib.decode_attention_bf16
        self._attn.restype = ctypes.c_int
        self._attn.argtypes = [_ptr, _i64] + [_ptr] * 4 + [_i64] * 6 + [_f32, _ptr]
        self._extend = lib.extend_attention_bf16
        self._extend.restype = ctypes.c_int
        self._extend.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr] + [_i64] * 5
        self._extend.argtypes += [_f32, _ptr]
        self._norm = lib.rms_norm_bf16
        self._norm.restype = None
        self._norm.argtypes = [_ptr, _i64, _ptr, _ptr, _f32, _i64, _i64, _ptr, _ptr]
        self._rope = lib.rope_bf16
        self._rope.restype = None
        self._rope.argtypes = [_ptr] + [_i64] * 4 + [_ptr] * 3
        self._silu_mul = lib.silu_mul_bf16
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_ptr, _i64, _i64, _ptr]
        self._greedy = lib.greedy_logprob_f32
        self._greedy.restype = ctypes.c_int
        self._greedy.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr]
        self._init_pool_kernels(lib)
        self._gemv = lib.gemv_packed_bf16
        self._gemv.restype = ctypes.c_int
        self._gemv.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr]
        self._gemm = lib.gemm_packed_bf16_blocked
        self._gemm.restype = ctypes.c_int
        self._gemm.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, ctypes.c_int]
        self._amx = lib.gemm_amx_bf16
        self._amx.restype = ctypes.c_int
        self._amx.argtypes = list(self._gemv.argtypes)
        self.has_amx = bool(lib.gemm_amx_bf16_available())  # AMX-BF16 tiles, granted by Linux
        self._decode_linear = lib.decode_linear_bf16
        self._decode_linear.restype = ctypes.c_int
        self._decode_linear.argtypes = list(self._gemv.argtypes)
        self._w8 = lib.gemm_w8_bf16
        self._w8.restype = ctypes.c_int
        self._w8.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr]
        self._w8_vnni = lib.gemm_w8_bf16_vnni
        self._w8_vnni.restype = ctypes.c_int
        self._w8_vnni.argtypes = list(self._w8.argtypes)
        self.has_w8 = bool(lib.gemm_w8_available())  # int8 weight products (VNNI or AVX2)
        self._w4 = lib.gemm_w4_bf16
        self._w4.restype = ctypes.c_int
        self._w4.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr]
        self.has_w4 = bool(lib.gemm_w4_available())  # AVX512-VNNI int4 weight products
        self._lora = lib.lora_sgmv_bf16
        self._lora.restype = ctypes.c_int
        self._lora.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64]
        self.has_gemm = bool(lib.gemm_packed_bf16_available())
        # Rows up to which linear_decode runs (beyond: oneDNN on its own packed copy, or
        # F.linear): the tiles', or gemv.c's row groups where there are no tiles (AVX2).
        self.decode_max_rows = GEMM_MAX_ROWS
        self.library_path = str(getattr(lib, "_name", ""))  # its build digest keys kernel plans

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm as transformers' Llama computes it in bfloat16, optionally after adding the
        residual stream: ``res = x + residual``; ``out = weight * bf16(res * rsqrt(mean(res^2)
        + eps))``, rounded where the torch ops round.

        Args:
            x: ``[T, H]`` bfloat16, last dim contiguous (rows may be strided).
            weight: ``[H]`` bfloat16.
            eps: the epsilon.
            residual: ``[T, H]`` bfloat16 contiguous, or None.

        Returns:
            ``(out, res)``, both ``[T, H]`` bfloat16; ``res`` is ``x`` itself without a
            residual.
        """
        t, h = x.shape
        out = torch.empty(t, h, dtype=torch.bfloat16)
        res = x if residual is None else torch.empty(t, h, dtype=torch.bfloat16)
        self._norm(
            x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
            weight.data_ptr(), eps, t, h, None if residual is None else res.data_ptr(),
            out.data_ptr(),
        )
        return out, res

    def rope_(
        self, qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotate ``qk [T, heads, D]`` (bfloat16, each row's heads contiguous, rows may be
        strided) in place by the float32 tables ``cos``/``sin [context, D / 2]`` at int64
        ``positions [T]``, rounding as ``rope.apply_rope`` does in bfloat16. Positions are
        not checked against the tables: the caller does."""
        t, heads, d = qk.shape
        self._rope(
            qk.data_ptr(), qk.stride(0), t, heads, d, positions.data_ptr(), cos.data_ptr(),
            sin.data_ptr(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up [T, 2 * I]`` bfloat16 contiguous -> ``silu(gate) * up`` ``[T, I]``
        bfloat16, rounded after the silu and after the product (as the torch ops round)."""
        t, n2 = gate_up.shape
        out = torch.empty(t, n2 // 2, dtype=torch.bfloat16)
        self._silu_mul(gate_up.data_ptr(), t, n2 // 2, out.data_ptr())
        return out

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Greedy tokens and their logprobs for float32 ``logits [B, V]`` (last dim
        contiguous): ``argmax`` (first of equal maxima) and ``log_softmax`` at it, in one pass
        per row. Returns ``(ids [B] int64, logprobs [B] float32)``, or None when a row holds
        a NaN or no finite value (the caller's torch path then decides)."""
        b, v = logits.shape
        ids = torch.empty(b, dtype=torch.long)
        logprobs = torch.empty(b, dtype=torch.float32)
        rc = self._greedy(
            logits.data_ptr(), logits.stride(0), b, v, ids.data_ptr(), logprobs.data_ptr()
        )
        return (ids, logprobs) if rc == 0 else None

    @staticmethod
    def can_pack_decode(weight: torch.Tensor) -> bool:
        """Whether :meth:`pack_decode` takes ``weight``: CPU bfloat16 ``[N, K]``, N a multiple
        of 16."""
        return (
            weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and weight.dim() == 2
            and weight.shape[0] % 16 == 0
        )

    @staticmethod
    def pack_decode(weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` -> ``[N / 16, ceil(K / 2), 16, 2]``: for 16 output rows, each pair
        of adjacent K values side by side (an odd K gets a zero column). One copy serves both
        decode products: ``vdpbf16ps`` takes the pairs as they are (:meth:`linear_gemm`), and the
        skinny stream splits them into even and odd K (:meth:`linear_skinny`). A copy; the
        original stays."""
        n, k = weight.shape
        w = weight.detach()
        if k % 2:
            w = torch.cat([w, w.new_zeros(n, 1)], dim=1)
        return w.reshape(n // 16, 16, (k + 1) // 2, 2).transpose(1, 2).contiguous()

    def linear_decode(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for a decode step of at most :attr:`decode_max_rows` rows: the
        AMX tiles at any row count where the CPU has them and K is a multiple of 32
        (:meth:`linear_amx`), else the skinny stream at 1-2 rows and the AVX512_BF16 tiles from
        3 (``decode_linear_bf16``, which the fused decode path calls too, so both paths give the
        same bits).

        Args:
            x: ``[M, K]`` bfloat16, ``1 <= M <= decode_max_rows``, last dim contiguous.
            packed: ``W`` from :meth:`pack_decode`.
            bias: ``[N]`` bfloat16 or None.

        Returns:
            ``[M, N]`` bfloat16: float32 sums (plus the bias) rounded to nearest even once.

        Raises:
            MemoryError: no memory for the skinny kernel's float32 copy of ``x``.
        """
        return _run_linear(self._decode_linear, "decode linear", x, packed, bias)

    def linear_w8(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
        bias: torch.Tensor | None, vnni_only: bool = False,
    ) -> torch.Tensor:
        """``x @ (s * Q).T + bias`` on int8 weights with a scale per row and block of 32
        (``gemm_w8.c``, AVX512-VNNI, or AMX-INT8 tiles where the CPU has them, ``gemm_amx.c``,
        or its AVX2 path on CPUs without AVX-512, the same bits by construction; check
        :attr:`has_w8`): ``x`` is quantized per row and group of 32 to int8 inside
        (``x_quant.h``), each group's sum is an exact integer, scaled and added
        in float32, rounded to bfloat16 once. ``vnni_only``: never the AMX tiles (the
        reference the tests hold them to).

        Args:
            x: ``[M, K]`` bfloat16, ``M >= 1``, last dim contiguous (rows may be strided).
            packed: ``Q`` from ``engine.model.quant.pack_int8_quads`` (uint8,
                ``[N/16, 8 * ceil(K/32), 16, 4]``).
            scales: ``engine.model.quant.Int8Weight.scales`` (float32 ``[N/16, G, 16]``, G =
                ``ceil(K/32)``).
            bias: ``[N]`` bfloat16 or None.

        Returns:
            ``[M, N]`` bfloat16.

        Raises:
            MemoryError: no memory for the int8 copy of ``x``.
            ValueError: the kernel does not run (no AVX512-VNNI in this build).
        """
        m, k = x.shape
        n = packed.shape[0] * 16
        y = torch.empty(m, n, dtype=torch.bfloat16)
        rc = (self._w8_vnni if vnni_only else self._w8)(
            x.data_ptr(), x.stride(0), m, packed.data_ptr(), scales.data_ptr(),
            None if bias is None else bias.data_ptr(), n, k, y.data_ptr(),
        )
        if rc == -1:
            raise MemoryError("int8 weight kernel: out of memory")
        if rc != 0:
            raise ValueError(f"int8 weight kernel: unsupported (x {tuple(x.shape)}, N {n})")
        return y

    def linear_w4(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x @ W'.T + bias`` on group-wise int4 weights (``gemm_w4.c``, AVX512-VNNI; check
        :attr:`has_w4`; ``engine.model.quant_int4`` has the scheme): ``x`` is quantized per row
        and group of 32 to int8 inside, each group's sum is an exact integer, scaled and added
        in float32, rounded to bfloat16 once.

        Args:
            x: ``[M, K]`` bfloat16, ``M >= 1``, ``K % 32 == 0``, last dim contiguous.
            packed: ``quant_int4.pack_int4`` (uint8, ``[N/16, K/8, 16, 4]``).
            scales: ``quant_int4.pack_int4_scales`` (float16, ``[N/16, K/32, 16]``).
            bias: ``[N]`` bfloat16 or None.

        Returns:
            ``[M, N]`` bfloat16.

        Raises:
            MemoryError: no memory for the int8 copy of ``x``.
            ValueError: the kernel does not run (no AVX512-VNNI in this build, bad shapes).
        """
        m, k = x.shape
        n = packed.shape[0] * 16
        y = torch.empty(m, n, dtype=torch.bfloat16)
        rc = self._w4(
            x.data_ptr(), x.stride(0), m, packed.data_ptr(), scales.data_ptr(),
            None if bias is None else bias.data_ptr(), n, k, y.data_ptr(),
        )
        if rc == -1:
            raise MemoryError("int4 weight kernel: out of memory")
        if rc != 0:
            raise ValueError(f"int4 weight kernel: unsupported (x {tuple(x.shape)}, N {n})")
        return y

    def linear_skinny(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` reading ``W`` once from memory (``gemv.c``; rows four at a time
        per block of 16 columns): the decode product up to :data:`SKINNY_MAX_ROWS` rows, and at
        every row count on CPUs without the AVX512_BF16 tiles.

        Args:
            x: ``[M, K]`` bfloat16, ``M >= 1``, last dim contiguous.
            packed: ``W`` from :meth:`pack_decode`.
            bias: ``[N]`` bfloat16 or None.

        Returns:
            ``[M, N]`` bfloat16: float32 dot products (plus the bias) rounded to nearest even
            once; equal to ``F.linear`` up to float32 summation order.

        Raises:
            MemoryError: no memory for the float32 copy of ``x``.
        """
        return _run_linear(self._gemv, "skinny linear", x, packed, bias)

    def linear_gemm(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        blocking: int = 0,
    ) -> torch.Tensor | None:
        """``x @ W.T + bias`` with the AVX512_BF16 register-blocked product (``gemm_bf16.c``).

        Args:
            x: ``[M, K]`` bfloat16, ``M >= 1``, last dim contiguous (rows may be strided).
            packed: ``W`` from :meth:`pack_decode`.
            bias: ``[N]`` bfloat16 or None.
            blocking: the tile shape (0: 8 rows x 48 columns; 1-3: the alternatives tried).

        Returns:
            ``[M, N]`` bfloat16: float32 sums (plus the bias) rounded to nearest even once;
            None where the kernel does not run (no AVX512_BF16 in this build: keep oneDNN).
        """
        m, k = x.shape
        n = packed.shape[0] * 16
        y = torch.empty(m, n, dtype=torch.bfloat16)
        rc = self._gemm(
            x.data_ptr(), x.stride(0), m, packed.data_ptr(),
            None if bias is None else bias.data_ptr(), n, k, y.data_ptr(), blocking,
        )
        return y if rc == 0 else None

    def linear_amx(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``x @ W.T + bias`` on AMX tiles (``gemm_amx.c``; check :attr:`has_amx`), on the
        same packed weight as :meth:`linear_gemm`, K a multiple of 32.

        Args:
            x: ``[M, K]`` bfloat16, ``M >= 1``, last dim contiguous (rows may be strided).
            packed: ``W`` from :meth:`pack_decode`.
            bias: ``[N]`` bfloat16 or None.

        Returns:
            ``[M, N]`` bfloat16: float32 sums in K order (plus the bias) rounded to nearest
            even once; None where the kernel does not run (no AMX, or K not a multiple of 32).
        """
        m, k = x.shape
        n = packed.shape[0] * 16
        y = torch.empty(m, n, dtype=torch.bfloat16)
        rc = self._amx(x.data_ptr(), x.stride(0), m, packed.data_ptr(),
                       None if bias is None else bias.data_ptr(), n, k, y.data_ptr())
        return y if rc == 0 else None

    def lora_sgmv(
        self, x: torch.Tensor, y: torch.Tensor, entry: int, slot_stride: int,
        rows: torch.Tensor, segments: torch.Tensor,
    ) -> None:
        """Add the LoRA products of the adapted rows to ``y`` in place (``lora.c``: per row,
        ``x A^T`` in float32, then each slice's ``(x A^T)[:, ro : ro + r] @ Bt`` into its
        columns, rounded once).

        Args:
            x: ``[T, K]`` bfloat16, last dim contiguous (rows may be strided).
            y: ``[T, N]`` bfloat16, the projection's output, last dim contiguous.
            entry: the address of the projection's entry of slot 0 in the LoRA table
                (``LORA_F`` int64s, ``engine.lora.adapters``); slot ``i``'s is
                ``slot_stride`` int64s further.
            slot_stride: int64s between two slots' entries.
            rows: ``[N]`` int64 adapted rows grouped by slot; segments: ``[G, 3]`` int64
                ``(slot, start in rows, count)`` (``forward_batch.AdapterRows``).

        Raises:
            MemoryError: no memory for the row blocks. ValueError: a rank above the kernel's.
        """
        rc = self._lora(
            x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1], entry,
            slot_stride, rows.data_ptr(), segments.data_ptr(), segments.shape[0],
        )
        if rc == -1:
            raise MemoryError("LoRA kernel: out of memory")
        if rc != 0:
            raise ValueError("LoRA kernel: a rank above its limit")

    def decode_attention(
        self,
        q: torch.Tensor,
        kt: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        window: int | None,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One query token per row against its slot's cached keys, in one pass per head.

        Args:
            q: ``[R, Hq, D]`` bfloat16; each row's heads contiguous (rows may be strided, as
                slices of a fused q/k/v projection are).
            kt: ``[num_slots, Hkv, cap / KT_TILE, D, KT_TILE]`` bfloat16 keys, transposed in
                tiles of :data:`KT_TILE` positions (``kernels.h``), contiguous.
            v: ``[num_slots, Hkv, cap, D]`` bfloat16 values, contiguous (``cap`` a multiple
                of :data:`KT_TILE`).
            slots: ``[R]`` int64 slot of each row.
            lens: ``[R]`` int64: row ``r`` attends to key positions ``0 .. lens[r] - 1`` (the
                last ``window`` of them with a sliding window); 0 leaves its output untouched.
            window: sliding window, or None.
            scale: softmax scale.
            out: ``[R, Hq, D]`` bfloat16, contiguous; written and returned.

        Scores, softmax and the value sum run in float32 (no intermediate bfloat16 rounding);
        the output is rounded to nearest even. Shapes the kernel takes: see :meth:`supports`.

        Raises:
            MemoryError: the kernel could not allocate its score buffers.
        """
        r, hq, d = q.shape
        hkv, cap = v.shape[1], v.shape[2]
        rc = self._attn(
            q.data_ptr(), q.stride(0), kt.data_ptr(), v.data_ptr(), slots.data_ptr(),
            lens.data_ptr(), r, hkv, hq // hkv, d, cap, window or 0, scale, out.data_ptr(),
        )
        if rc == -1:
            raise MemoryError("decode attention kernel: out of memory")
        if rc != 0:
            raise ValueError(f"decode attention kernel: unsupported shape q {tuple(q.shape)}")
        return out

    def extend_attention(
        self,
        q: torch.Tensor,
        pool_buffer: torch.Tensor,
        layer: int,
        pages: torch.Tensor,
        seq_len: int,
        window: int | None,
        scale: float,
    ) -> torch.Tensor | None:
        """One sequence's new tokens against its whole paged K/V (prefix and new tokens, already
        in the pool), causal, in one flash-attention pass (``extend_attention.c``).

        Args:
            q: ``[n, Hq, D]`` bfloat16, the sequence's last ``n`` tokens (positions
                ``seq_len - n ..``); each token's heads contiguous (tokens may be strided).
            pool_buffer: the pool, ``[num_pages, L, 2, page_size, Hkv, D]`` bfloat16,
                contiguous.
            layer: layer index.
            pages: ``[>= ceil(seq_len / page_size)]`` int64 page ids of the sequence, contiguous.
            seq_len: tokens in the sequence, new ones included.
            window: sliding window (each query sees its last ``window`` keys), or None.
            scale: softmax scale.

        Returns:
            ``[n, Hq, D]`` bfloat16, or None where the kernel does not apply (no AVX512-BF16,
            ``D`` not a multiple of 16 up to 256): the caller keeps torch's SDPA then.

        Raises:
            MemoryError: the kernel could not allocate its packed K/V (~``seq_len * Hkv * D * 4``
                bytes).
        """
        n, hq, d = q.shape
        hkv, ps = pool_buffer.shape[4], pool_buffer.shape[3]
        base = pool_buffer[0, layer]
        out = torch.empty(n, hq, d, dtype=torch.bfloat16)
        rc = self._extend(
            q.data_ptr(), q.stride(0), n, base[0].data_ptr(), base[1].data_ptr(),
            pool_buffer.stride(0), ps, pages.data_ptr(), seq_len, hkv, hq // hkv, d,
            window or 0, scale, out.data_ptr(),
        )
        if rc == -1:
            raise MemoryError("extend attention kernel: out of memory")
        return out if rc == 0 else None

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether :meth:`decode_attention` takes these heads: at most 8 query heads per KV
        head and ``head_dim`` a multiple of 16 up to 256."""
        g = num_heads // num_kv_heads
        return 1 <= g <= 8 and head_dim % 16 == 0 and head_dim <= 256


def _run_linear(
    fn: Any, name: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Call a C product ``fn(x, x_stride, m, wp, bias, n, k, y)`` on a weight from
    :meth:`CpuKernels.pack_decode`; its return code -1 becomes MemoryError, others ValueError."""
    m, k = x.shape
    n = packed.shape[0] * 16
    y = torch.empty(m, n, dtype=torch.bfloat16)
    rc = fn(
        x.data_ptr(), x.stride(0), m, packed.data_ptr(),
        None if bias is None else bias.data_ptr(), n, k, y.data_ptr(),
    )
    if rc == -1:
        raise MemoryError(f"{name} kernel: out of memory")
    if rc != 0:
        raise ValueError(f"{name} kernel: unsupported shape x {tuple(x.shape)}")
    return y


