"""ctypes bindings of the C kernels that write KV pool pages: the KV append (``kv_append.c``
for bfloat16 pages, ``kv_quant.c`` for 8-bit ones) and the fused decode layers
(``decode_layers.c``), which append inside their layer loop; and the extend attention over
8-bit pages (``extend_attention.c``, de-quantizing as it reads). Mixed into
:class:`~splitserve.engine.kernels.cpu.bindings.CpuKernels`; the pool layouts are
:class:`~splitserve.engine.kv_pool.KVPool`'s.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from splitserve.engine.kv_pool import KVPool

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# decode_layers_bf16's and kv_append_q8's kv_kind (kernels.h).
KV_KINDS = {"auto": 0, "int8": 1, "fp8_e4m3": 2}


def _pool_kind(pool: KVPool) -> int:
    """The C ``kv_kind`` of ``pool``.

    Raises:
        ValueError: a pool the kernels cannot write (not bfloat16 or 8-bit, or not contiguous).
    """
    kind = KV_KINDS[pool.layout.kv_cache_dtype]
    if (kind == 0 and pool.buffer.dtype != torch.bfloat16) or not pool.buffer.is_contiguous():
        raise ValueError(
            f"C KV append: unsupported pool ({pool.layout}, contiguous "
            f"{pool.buffer.is_contiguous()})"
        )
    return kind


class PoolKernels:
    """The pool-writing kernels of the loaded library (see the module docstring)."""

    def _init_pool_kernels(self, lib: ctypes.CDLL) -> None:
        self._append = lib.kv_append_bf16
        self._append.restype = None
        self._append.argtypes = [_ptr, _i64, _ptr, _i64] + [_i64] * 3 + [_ptr, _ptr, _i64]
        self._append.argtypes += [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
        self._append_q8 = lib.kv_append_q8
        self._append_q8.restype = None
        self._append_q8.argtypes = [_ptr, _i64, _ptr, _i64] + [_i64] * 3 + [_ptr] + [_i64] * 5
        self._append_q8.argtypes += [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
        self._extend_q8 = lib.extend_attention_q8
        self._extend_q8.restype = ctypes.c_int
        self._extend_q8.argtypes = [_ptr, _i64, _i64, _ptr] + [_i64] * 6 + [_ptr] + [_i64] * 5
        self._extend_q8.argtypes += [_f32, _ptr]
        self._decode_q8 = lib.decode_attention_q8
        self._decode_q8.restype = ctypes.c_int
        self._decode_q8.argtypes = [_ptr, _i64, _ptr] + [_i64] * 6 + [_ptr, _i64, _ptr]
        self._decode_q8.argtypes += [_i64] * 5 + [_f32, _ptr]
        self._quantize = lib.kv_quantize_bf16
        self._quantize.restype = None
        self._quantize.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr]
        self._layers = lib.decode_layers_bf16
        self._layers.restype = ctypes.c_int
        self._layers.argtypes = [_i64, _ptr, _ptr] + [_i64] * 6 + [_f32, _f32, _i64]
        self._layers.argtypes += [_ptr] * 4 + [_i64] * 3 + [_ptr] * 4 + [_i64] * 2 + [_ptr] * 3
        self._layers.argtypes += [_i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64]

    def kv_quantize(
        self, x: torch.Tensor, kind: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The C quantizer of 8-bit pools on ``x [N, D]`` (bfloat16, contiguous), for tests
        against :func:`splitserve.engine.kv_quant.quantize_kv`: ``(q [N, D]`` int8 or
        float8_e4m3fn, ``scales [N]`` float32, ``round_trip [N, D]`` bfloat16``)``.

        Raises:
            KeyError: ``kind`` is not ``"int8"`` or ``"fp8_e4m3"``.
        """
        code = {"int8": 1, "fp8_e4m3": 2}[kind]
        n, d = x.shape
        q = torch.empty(n, d, dtype=torch.uint8)
        scales = torch.empty(n, dtype=torch.float32)
        rt = torch.empty(n, d, dtype=torch.bfloat16)
        self._quantize(x.data_ptr(), n, d, code, q.data_ptr(), scales.data_ptr(), rt.data_ptr())
        dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
        return q.view(dtype), scales, rt

    def kv_append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: KVPool,
        layer: int,
        page_ids: torch.Tensor,
        offsets: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Write new tokens' K/V of ``layer`` into the pool and, optionally, the decode cache:
        as :meth:`KVPool.write` and ``DecodeKVCache.append`` do, bit for bit (an 8-bit pool:
        quantized as ``kv_quant.quantize_kv``, the cache given ``round_trip_kv``'s values).

        Args:
            k: ``[T, Hkv, D]`` bfloat16, each row's heads contiguous (rows may be strided).
            v: the same for values.
            pool: a bfloat16 or 8-bit pool, buffer contiguous.
            layer: layer index.
            page_ids: ``[T]`` int64 page of each token; offsets: ``[T]`` int64 slot in it.
            cache: ``(kt [slots, Hkv, cap / KT_TILE, D, KT_TILE], v [slots, Hkv, cap, D],
                slots [T], pos [T])`` of this layer (bfloat16, contiguous, keys tiled as
                :meth:`CpuKernels.decode_attention` reads them; int64 indices), or None: the
                pool only.

        Raises:
            ValueError: a pool the kernel cannot write.
        """
        t, hkv, d = k.shape
        kind = _pool_kind(pool)
        ckt, cv, slots, pos = cache if cache is not None else (None, None, None, None)
        tail = (
            page_ids.data_ptr(),
            offsets.data_ptr(),
            None if ckt is None else ckt.data_ptr(),
            None if cv is None else cv.data_ptr(),
            0 if cv is None else cv.shape[2],
            None if slots is None else slots.data_ptr(),
            None if pos is None else pos.data_ptr(),
        )
        kv = pool.kv
        if kind == 0:
            base = kv[0, layer]
            self._append(
                k.data_ptr(),
                k.stride(0),
                v.data_ptr(),
                v.stride(0),
                t,
                hkv,
                d,
                base[0].data_ptr(),
                base[1].data_ptr(),
                kv.stride(0),
                *tail,
            )
            return
        self._append_q8(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            t,
            hkv,
            d,
            pool.buffer.data_ptr(),
            layer * kv.stride(1),
            layer * kv.stride(1) + kv.stride(2),
            kv.stride(0),
            pool.layout.value_bytes,
            kind,
            *tail,
        )

    def decode_layers(
        self,
        ptrs: torch.Tensor,
        x: torch.Tensor,
        cfg: Any,
        rope: Any,
        positions: torch.Tensor,
        pool: KVPool,
        page_ids: torch.Tensor,
        offsets: torch.Tensor,
        kt: torch.Tensor | None,
        v: torch.Tensor | None,
        slots: torch.Tensor | None,
        cache_positions: torch.Tensor | None,
        lens: torch.Tensor,
        window: int | None,
        lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        pages: torch.Tensor | None = None,
    ) -> int:
        """Every decoder layer of a decode-only step in one call (``decode_layers.c``); the
        caller (:mod:`splitserve.engine.model.fused_decode`) runs it where the step plan says it
        applies (``engine.step_plan``).

        Args:
            ptrs: ``[L * 15]`` int64 per-layer weight addresses (``fused_decode.layer_pointers``).
            x: ``[M, hidden]`` bfloat16 contiguous hidden states, updated in place.
            cfg: the ``ModelConfig`` (sizes, ``rms_norm_eps``).
            rope: the model's ``RotaryEmbedding`` (float32 tables).
            positions: ``[M]`` int64 token positions.
            pool: the KV pool, bfloat16 or 8-bit (new K/V written as :meth:`kv_append` does).
            page_ids: ``[M]`` int64 page of each new token; offsets: ``[M]`` its slot there.
            kt: ``[L, slots, Hkv, cap / KT_TILE, D, KT_TILE]`` decode-cache keys (tiled); v:
                ``[L, slots, Hkv, cap, D]``;
                None (with ``slots`` and ``cache_positions``): no cache, an 8-bit pool read in
                place through ``pages`` (``decode_attention_q8.c``).
            slots: ``[M]`` int64 cache slot of each row; cache_positions: ``[M]`` its position.
            lens: ``[M]`` int64 KV length after the step.
            window: sliding window, or None.
            lora: ``(table, rows, segments)``: the LoRA slot table (``[slots, L * 4, LORA_F]``
                int64, ``engine.lora.adapters``) and the step's adapted rows by slot
                (``forward_batch.AdapterRows``); None: no row has an adapter.
            pages: ``[M, P]`` int64 page ids of each row's sequence (last dimension
                contiguous), read where ``kt`` is None.

        Returns:
            0, or the failing kernel's error code (-1: out of memory, -2: a LoRA rank above
            the C kernel's, or no cache over a bfloat16 pool).

        Raises:
            ValueError: a pool the kernels cannot write.
        """
        m, hid = x.shape
        kind, kv = _pool_kind(pool), pool.kv
        if kt is None and pages is None:
            raise ValueError("decode_layers: neither a decode cache nor a page table")
        return self._layers(
            ptrs.numel() // 15,
            ptrs.data_ptr(),
            x.data_ptr(),
            m,
            hid,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
            window or 0,
            positions.data_ptr(),
            rope.cos.data_ptr(),
            rope.sin.data_ptr(),
            pool.buffer.data_ptr(),
            kv.stride(1),
            kv.stride(2),
            kv.stride(0),
            page_ids.data_ptr(),
            offsets.data_ptr(),
            None if kt is None else kt.data_ptr(),
            None if v is None else v.data_ptr(),
            0 if kt is None else kt.stride(0),
            0 if v is None else v.shape[3],
            None if slots is None else slots.data_ptr(),
            None if cache_positions is None else cache_positions.data_ptr(),
            lens.data_ptr(),
            kind,
            pool.layout.value_bytes if kind else 0,
            None if pages is None else pages.data_ptr(),
            0 if pages is None else pages.stride(0),
            pool.page_size,
            *_lora_args(lora),
        )

    def extend_attention_q8(
        self,
        q: torch.Tensor,
        pool: KVPool,
        layer: int,
        pages: torch.Tensor,
        seq_len: int,
        window: int | None,
        scale: float,
    ) -> torch.Tensor | None:
        """``CpuKernels.extend_attention`` over an 8-bit pool: each K/V row is de-quantized as
        ``KVPool.gather`` reads it (bfloat16) as the kernel packs it, so the result is, bit for
        bit, the bfloat16 kernel's over a bfloat16 pool holding the de-quantized values.

        Args:
            q: ``[n, Hq, D]`` bfloat16, the sequence's last ``n`` tokens (heads contiguous).
            pool: an int8 or fp8_e4m3 pool, buffer contiguous.
            layer: layer index.
            pages: ``[>= ceil(seq_len / page_size)]`` int64 page ids, contiguous.
            seq_len: tokens in the sequence, new ones included.
            window: sliding window, or None.
            scale: softmax scale.

        Returns:
            ``[n, Hq, D]`` bfloat16, or None where the kernel does not apply (no AVX512-BF16,
            ``D`` not a multiple of 16 up to 256).

        Raises:
            MemoryError: the kernel could not allocate its packed K/V.
            ValueError: a pool the kernel cannot read.
        """
        kind, kv = _pool_kind(pool), pool.kv
        if kind == 0:
            raise ValueError("extend_attention_q8 reads 8-bit pools; use extend_attention")
        n, hq, d = q.shape
        hkv, ps = kv.shape[4], kv.shape[3]
        out = torch.empty(n, hq, d, dtype=torch.bfloat16)
        k_off = layer * kv.stride(1)
        rc = self._extend_q8(
            q.data_ptr(),
            q.stride(0),
            n,
            pool.buffer.data_ptr(),
            k_off,
            k_off + kv.stride(2),
            kv.stride(0),
            pool.layout.value_bytes,
            kind,
            ps,
            pages.data_ptr(),
            seq_len,
            hkv,
            hq // hkv,
            d,
            window or 0,
            scale,
            out.data_ptr(),
        )
        if rc == -1:
            raise MemoryError("extend attention kernel: out of memory")
        return out if rc == 0 else None


    def decode_attention_q8(
        self,
        q: torch.Tensor,
        pool: KVPool,
        layer: int,
        pages: torch.Tensor,
        lens: torch.Tensor,
        window: int | None,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One query token per row against its sequence's K/V read where an 8-bit pool keeps
        them (``decode_attention_q8.c``): each value de-quantized in registers, no bfloat16
        copy of the sequence. Scores, softmax and the value sum run in float32 over the values
        exactly as stored (``float(code) * scale``, not rounded to bfloat16 first, unlike
        :meth:`KVPool.gather`); the output is rounded to nearest even.

        Args:
            q: ``[R, Hq, D]`` bfloat16; each row's heads contiguous (rows may be strided).
            pool: an int8 or fp8_e4m3 pool, buffer contiguous.
            layer: layer index.
            pages: ``[R, P]`` int64 page ids of each row's sequence (``P >= ceil(lens[r] /
                page_size)``), last dimension contiguous (rows may be strided, as page-table
                slices are).
            lens: ``[R]`` int64: row ``r`` attends to positions ``0 .. lens[r] - 1`` (the last
                ``window`` of them with a sliding window); 0 leaves its output untouched.
            window: sliding window, or None.
            scale: softmax scale.
            out: ``[R, Hq, D]`` bfloat16, contiguous; written and returned.

        Raises:
            MemoryError: the kernel could not allocate its score buffers.
            ValueError: a bfloat16 pool, or a shape the kernel does not take
                (:meth:`CpuKernels.supports`).
        """
        kind, kv = _pool_kind(pool), pool.kv
        if kind == 0:
            raise ValueError("decode_attention_q8 reads 8-bit pools; use decode_attention")
        r, hq, d = q.shape
        hkv = kv.shape[4]
        if (hq % hkv or d != kv.shape[5] or out.shape != q.shape or out.dtype != torch.bfloat16
                or not out.is_contiguous() or q.dtype != torch.bfloat16 or q.stride(2) != 1
                or q.stride(1) != d or pages.dtype != torch.int64 or pages.stride(1) != 1
                or lens.dtype != torch.int64 or lens.shape != (r,) or pages.shape[0] != r):
            raise ValueError(
                f"decode attention kernel: unsupported shape q {tuple(q.shape)} over "
                f"{hkv} KV heads of {kv.shape[5]}, out {tuple(out.shape)}, pages "
                f"{tuple(pages.shape)} {pages.dtype}, lens {tuple(lens.shape)} {lens.dtype}"
            )
        k_off = layer * kv.stride(1)
        rc = self._decode_q8(
            q.data_ptr(), q.stride(0), pool.buffer.data_ptr(), k_off, k_off + kv.stride(2),
            kv.stride(0), pool.layout.value_bytes, kind, pool.page_size, pages.data_ptr(),
            pages.stride(0), lens.data_ptr(), r, hkv, hq // hkv, d, window or 0, scale,
            out.data_ptr(),
        )
        if rc == -1:
            raise MemoryError("decode attention kernel: out of memory")
        if rc != 0:
            raise ValueError(f"decode attention kernel: unsupported shape q {tuple(q.shape)}")
        return out


def _lora_args(lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> tuple:
    """``decode_layers_bf16``'s last five arguments for ``(table, rows, segments)``."""
    if lora is None:
        return (None, 0, None, None, 0)
    table, rows, segments = lora
    return (table.data_ptr(), table.stride(0), rows.data_ptr(), segments.data_ptr(),
            segments.shape[0])
