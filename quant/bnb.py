"""bitsandbytes' weight formats, run by bitsandbytes itself: the yardstick for lowbit's own layouts
(`lowbit eval --weights bnb-nf4,bnb-int8`). Quantization, dequantization and the matmul are all
bitsandbytes' calls, configured as `transformers`' `BitsAndBytesConfig` configures them by default,
so a row measures what people who load a model with bitsandbytes today actually get.

    bnb-nf4   4-bit NormalFloat codes (16 levels placed at normal quantiles), one fp32 absmax per 64
              weights along the flattened [N, K] matrix, no double quantization: 4.5 bits/weight.
              Matmul: bitsandbytes' matmul_4bit, fp32 compute.
              packed  uint8 [N*K/2, 1]   two codes per byte, flat row-major order
              absmax  fp32  [N*K/64]
              code    fp32  [16]         the NF4 levels
    bnb-int8  LLM.int8(): int8 weights with one absmax per output row, activations quantized to
              int8 per row at run time, input columns with an outlier (|x| > 6.0) multiplied in
              fp16 instead: 8 bits/weight + 32 per row. Matmul: bitsandbytes' matmul (MatMul8bitLt)
              in inference mode; activations in fp16, as bitsandbytes casts them.
              CB      int8  [N, K]
              SCB     fp32  [N]          absmax of each row (w = CB * SCB / 127)

CPU only here: lowbit's CUDA backend multiplies with its own Triton kernel and does not call
bitsandbytes. bitsandbytes is imported when one of these layouts is first used, not before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.quant.spec import WeightSpec

NF4_BLOCK = 64  # transformers' default bnb_4bit blocksize
INT8_THRESHOLD = 6.0  # transformers' default llm_int8_threshold


def _bnb():
    try:
        import bitsandbytes
        import bitsandbytes.functional
    except ImportError:
        raise ValueError("the bnb-* weight layouts need bitsandbytes (pip install bitsandbytes)") from None
    return bitsandbytes


@dataclass
class BnbWeight:
    spec: WeightSpec  # codec "nf4" or "llm.int8"
    out_features: int
    in_features: int
    packed: torch.Tensor | None = None  # nf4: uint8 [N*K/2, 1]
    absmax: torch.Tensor | None = None  # nf4: fp32 [N*K/64]
    code: torch.Tensor | None = None  # nf4: fp32 [16]
    CB: torch.Tensor | None = None  # llm.int8: int8 [N, K]
    SCB: torch.Tensor | None = None  # llm.int8: fp32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))

    def _quant_state(self):
        F = _bnb().functional
        return F.QuantState(absmax=self.absmax, shape=torch.Size(self.shape), code=self.code, blocksize=NF4_BLOCK,
                            quant_type="nf4", dtype=torch.float32)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], by bitsandbytes' own dequantization."""
        F = _bnb().functional
        if self.spec.codec == "nf4":
            return F.dequantize_4bit(self.packed, self._quant_state()).float()
        return F.int8_vectorwise_dequant(self.CB, self.SCB).float()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] → fp32 [M, N] through bitsandbytes' matmul."""
        bnb = _bnb()
        if self.spec.codec == "nf4":
            return bnb.matmul_4bit(x.float(), self.packed.t(), quant_state=self._quant_state())
        from bitsandbytes.autograd._functions import MatmulLtState

        state = MatmulLtState()  # what Linear8bitLt(has_fp16_weights=False).eval() hands to matmul
        state.CB, state.SCB, state.threshold = self.CB, self.SCB, INT8_THRESHOLD
        state.has_fp16_weights = state.is_training = False
        return bnb.matmul(x.half(), self.CB, state=state).float()

    def rows(self, index: torch.Tensor) -> "BnbWeight":
        """The same layout restricted to some output rows (used to un-permute GGUF Q/K rows)."""
        N, K = self.shape
        if self.spec.codec == "nf4":  # K % 64 == 0, so every block lies inside one row
            packed = self.packed.view(N, K // 2)[index].reshape(-1, 1)  # [N*K/2, 1]
            return BnbWeight(self.spec, N, K, packed, self.absmax.view(N, K // NF4_BLOCK)[index].reshape(-1),
                             self.code)
        return BnbWeight(self.spec, N, K, CB=self.CB[index].contiguous(), SCB=self.SCB[index].contiguous())


def quantize(w: torch.Tensor, spec: WeightSpec) -> BnbWeight:
    """[N, K] float matrix → BnbWeight, by bitsandbytes' quantize_4bit / int8_vectorwise_quant."""
    F = _bnb().functional
    N, K = w.shape
    if spec.codec == "nf4":
        if K % NF4_BLOCK:
            raise ValueError(f"bnb-nf4 needs rows that are whole blocks of {NF4_BLOCK} weights; this matrix has {K}")
        packed, st = F.quantize_4bit(w.float().contiguous(), blocksize=NF4_BLOCK, quant_type="nf4",
                                     compress_statistics=False)
        return BnbWeight(spec, N, K, packed, st.absmax, st.code)
    CB, SCB, _ = F.int8_vectorwise_quant(w.half().contiguous())  # Linear8bitLt quantizes its fp16 weight
    return BnbWeight(spec, N, K, CB=CB, SCB=SCB)
