"""The fast backend: weights kept compact, multiplied by the engine's C kernels and torch's.

Per CPU (cpu.py): GGUF's 4- and 5-bit types keep the file's codes, a half scale and min per
32 weights, laid out for runtime/kernels/lowbit_rows.c (`LowBitWeight`: integer dots over
activations rounded to int8 per block of 32, as llama.cpp multiplies Q4_1 by Q8_1); where
that kernel cannot be built, torch's group-wise int4 layout (`Int4Weight`, bf16 activations:
torch's int4 kernel with float32 activations takes a path ~20x slower). Q8_0 and Q6_K as
the file's codes for runtime/kernels/int8_rows.c, 16 rows side by side
(`Int8BlockGroupWeight`; a row at a time, `Int8BlockWeight`, where the plan says so).
Other types fp16: fbgemm's, or runtime/kernels/dense_rows.c's on AVX2 (`Fp16RowsWeight`);
bf16 where no C compiler works. The LM head int8 per row where its rows allow it:
lowbit_rows.c's 8-bit build with VNNI (`Int8GroupWeight`), else runtime/kernels/int8_rows.c;
on AVX2 as its file type says (`Int8BlockGroupHead` for Q8_0). The integer layouts apply a
preceding RMSNorm weight at run time; the dense stores fold it into their columns.
Called with float32 numpy arrays they return numpy arrays, so the host forward pass shares
model files and attention with the numpy backend; each weight's `product` takes and gives
float32 tensors, which is what the tensor forward pass (kernels/device_backend.py) calls on
the CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import numpy as np
import threadpoolctl
import torch

from runtime.gguf_file import GGUFFile
from runtime.kernels import pages, repack
from runtime.kernels.base import TensorPart
from runtime.kernels.core_share import share_cores
from runtime.kernels.cpu import LARGE_HEAD_ROWS, KernelPlan, cpu_features, default_plan
from runtime.kernels.gguf_blocks import (
    EIGHT_BIT_TYPES,
    FIVE_BIT_TYPES,
    FOUR_BIT_TYPES,
    GROUP_SIZE,
    PER_16_TYPES,
    TWO_BIT_TYPES,
    BlockCodes,
    GroupQuantized,
    Q,
    TwoBitCodes,
    quantize_groups,
    read_eight_bit,
    read_five_bit,
    read_four_bit,
    read_two_bit,
)
from runtime.kernels.native import (
    INT8_GROUP,
    LOWBIT_GROUP,
    LOWBIT_GROUP_BYTES,
    Int8GroupsProduct,
    LowBitProduct,
    dense_rows,
    int8_rows,
    lowbit_builds,
    lowbit_rows,
    lowbit_shape,
    nibble_rows,
    pack_int8_groups,
    pack_int8_rows,
    pack_lowbit,
    pack_nibble_groups,
)
from runtime.kernels.prepared import PreparedWeights, SavedWeight, weight_key
from runtime.kernels.quant_types import log_types, torch_kept_as

INNER_K_TILES = 2  # what the CPU int4 packing accepts (2, 4 or 8); the CPU kernel ignores it
HEAD_CHUNK_ROWS = 8192  # rows dequantized at a time while building a head
# int8 per row is used only where it is accurate enough: the 99th percentile over rows of
# the relative RMS error of the requantized row. Measured: SmolLM2's Q8_0 embedding 1.4%
# (teacher-forced top-1 vs llama.cpp 96.5% with an int8 head), Gemma 3's 4.2% (94.9% with
# int8, 96.0% with bf16): its rows have outliers that one scale per row cannot hold.
MAX_INT8_ROW_ERROR = 0.02
# Where a head fails that (Gemma 3's Q8_0), an int4 copy of it only ranks the vocabulary:
# each query's best RESCORED_ROWS are recomputed from the file's own rows, so the logits of
# every likely next token are the file's exactly, at an int4 head's cost (105 MB read a
# token where bf16 read 335 MB: Gemma 3's head took 3.1 ms at 1 row, bf16 10.6, int8 5.0).
# On 64 random queries the exact top-1 was always among int4's best 32.
RESCORED_ROWS = 64


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor over `a`, copied when `a` is a read-only view (of the mapped file)."""
    return torch.from_numpy(a if a.flags.writeable else np.array(a))


def _scale(input_scale: np.ndarray | None) -> torch.Tensor | None:
    return None if input_scale is None else _tensor(input_scale.astype(np.float32))


def _as_tensor(x: np.ndarray) -> torch.Tensor:
    """A float32 tensor sharing `x`'s memory where it can."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


class _Product:
    """A weight whose `product` takes and gives float32 tensors; called with a numpy array
    (the host forward pass), it gives one back."""

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.product(_as_tensor(x)).numpy()


class _HostKernel(_Product):
    """A weight whose `__call__` is its numpy kernel: `product` runs that on the tensor's
    array (the torch forward pass on the host)."""

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self(x.numpy()))


class Int4Weight(_Product):
    """torch's int4 layout: value = (code - 8) * scale + zero, per 32 weights of a row."""

    kind = "int4"

    def __init__(self, q: GroupQuantized, input_scale: np.ndarray | None) -> None:
        self.shape: tuple[int, int] = q.shape
        codes = torch.from_numpy(q.codes).to(torch.int32)  # [N, K], one tensor at a time
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
        zeros = q.mins + np.float32(8) * q.scales
        pairs = np.stack([q.scales, zeros], axis=-1).transpose(1, 0, 2)  # [K/32, N, 2]
        self.scales_zeros = torch.from_numpy(np.ascontiguousarray(pairs)).to(torch.bfloat16)
        self.input_scale = _scale(input_scale)

    def saved(self) -> dict[str, torch.Tensor]:
        tensors = {"packed": self.packed, "scales_zeros": self.scales_zeros}
        return tensors | ({} if self.input_scale is None else {"input_scale": self.input_scale})

    @classmethod
    def stacked(cls, parts: list[Int4Weight]) -> Int4Weight:
        """One weight of `parts`' rows in order (torch's CPU packing is per row)."""
        tensors = {
            "packed": torch.cat([p.packed for p in parts]),
            "scales_zeros": torch.cat([p.scales_zeros for p in parts], dim=1),
        }
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        return cls.restored(shape, tensors)

    @classmethod
    def restored(cls, shape: tuple[int, int], tensors: dict[str, torch.Tensor]) -> Int4Weight:
        weight = cls.__new__(cls)
        weight.shape, weight.packed = shape, tensors["packed"]
        weight.scales_zeros = tensors["scales_zeros"]
        weight.input_scale = tensors.get("input_scale")
        return weight

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """float32 `[T, K]` -> float32 `[T, N]` (the tensor forward pass calls this)."""
        if self.input_scale is not None:
            x = x * self.input_scale
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_zeros
        )  # [T, K] -> [T, N] bf16
        return out.float()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


BITS_OF_BLOCK_BYTES = {LOWBIT_GROUP_BYTES[bits]: bits for bits in (4, 5)}


class LowBitWeight(_HostKernel):
    """GGUF's 4- and 5-bit weights as runtime/kernels/lowbit_rows.c multiplies them: the
    file's codes with a half scale and min per 32 weights, 16 rows side by side
    (`native.pack_lowbit`), and activations rounded to int8 per block of 32, as llama.cpp
    multiplies Q4_1 by Q8_1. Integer dots made SmolLM2's layer products 2.3x torch's int4
    kernel at 1 row and 1.7-1.9x at 4 to 128 on an AVX512-BF16 EPYC
    (`bench/lowbit_products.py`), and a row's result is the same whatever shares its batch.
    Chosen wherever the kernel builds (`LLMQ_TORCH_INT4=1` keeps `Int4Weight` for 4-bit and
    the dense kind for 5-bit)."""

    kinds = {4: "int4-blocks", 5: "int5-blocks"}

    def __init__(self, q: GroupQuantized, bits: int, input_scale: np.ndarray | None) -> None:
        self.shape: tuple[int, int] = q.shape
        self.bits = bits
        self.packed = torch.from_numpy(pack_lowbit(q, bits))
        self.input_scale = _scale(input_scale)

    @property
    def kind(self) -> str:
        return self.kinds[self.bits]

    def saved(self) -> dict[str, torch.Tensor]:
        scale = {} if self.input_scale is None else {"input_scale": self.input_scale}
        return {"packed": self.packed} | scale

    @classmethod
    def restored(cls, shape: tuple[int, int], tensors: dict[str, torch.Tensor]) -> LowBitWeight:
        """The weight over saved tensors; its code width is its packing's block size."""
        weight = cls.__new__(cls)
        weight.shape, weight.packed = shape, tensors["packed"]
        weight.bits = BITS_OF_BLOCK_BYTES[weight.packed.shape[-1]]
        weight.input_scale = tensors.get("input_scale")
        return weight

    @functools.cached_property
    def _bound(self) -> LowBitProduct:
        scale = None if self.input_scale is None else self.input_scale.numpy()
        return lowbit_rows(self.bits).bind(self.packed.numpy(), self.shape[0], scale)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The host forward pass's call: numpy in, numpy out, no tensor in between."""
        return self._bound(x)

    def normed(self, x: np.ndarray, eps: float) -> np.ndarray:
        """`self(rms_normalize(x, eps))` with the norm done by the kernel as it reads the rows
        (runtime/models/base.py `normed_linear`)."""
        return self._bound(x, eps)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


class _RowStore(_Product):
    """A weight whose storage is allocated whole and filled a chunk of rows at a time, so a
    262k-row head never exists as one float32 array."""

    kind = ""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        self._allocate()

    @classmethod
    def from_dense(cls, dense: np.ndarray):
        weight = cls(dense.shape)
        weight.fill(0, dense)
        return weight

    def _allocate(self) -> None:
        raise NotImplementedError

    def fill(self, start: int, rows: np.ndarray) -> None:
        raise NotImplementedError

    tensor_names: tuple[str, ...] = ()  # the tensors `_allocate` makes

    def saved(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.tensor_names}

    @classmethod
    def restored(cls, shape: tuple[int, int], tensors: dict[str, torch.Tensor]):
        weight = cls.__new__(cls)
        weight.shape = shape
        for name in cls.tensor_names:
            setattr(weight, name, tensors[name])
        return weight


class Int8Weight(_RowStore):
    """int8 per row, symmetric: value = code * scale[row], the scale rounded to bf16 first
    so that the codes are chosen for the scale the kernel will use. On the CPU the product
    is runtime/kernels/int8_rows.c (activations rounded to int8 per block of 32, integer
    dots: 2x torch's `_weight_int8pack_mm` at 1 and at 32 rows on SmolLM2's head, and
    closer to the float32 reference than its bf16 activations); elsewhere, or without a C
    compiler, torch's kernel."""

    kind = "int8"
    tensor_names = ("codes", "scales")

    def _allocate(self) -> None:
        self.codes = torch.empty(self.shape, dtype=torch.int8)
        self.scales = torch.empty(self.shape[0], dtype=torch.bfloat16)

    @staticmethod
    def quantized(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 rows -> (int8 codes, bf16 row scales), the codes chosen for the scale."""
        peak = t.abs().amax(dim=1).clamp_min(1e-30)
        scales = (peak / 127).to(torch.bfloat16)
        codes = torch.round(t / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return codes, scales

    def fill(self, start: int, rows: np.ndarray) -> None:
        codes, scales = self.quantized(_tensor(rows))
        self.codes[start : start + len(rows)] = codes
        self.scales[start : start + len(rows)] = scales

    def product(self, x: torch.Tensor) -> torch.Tensor:
        kernel = int8_rows()
        if kernel is None or x.device.type != "cpu" or not kernel.accepts(self.shape[1]):
            return torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16), self.codes, self.scales
            ).float()
        return torch.from_numpy(kernel(x.numpy(), self.codes.numpy(), self.float_scales))

    @functools.cached_property
    def float_scales(self) -> np.ndarray:
        """The bf16 row scales as float32 (exactly), made once: the native kernel's form."""
        return self.scales.float().numpy()

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


class Int8GroupWeight(_HostKernel, _RowStore):
    """`Int8Weight`'s codes and bf16-rounded row scales, laid out for lowbit_rows.c's 8-bit
    build (16 rows side by side, each code plus 128; `native.pack_int8_rows`): a block of 16
    rows' dots is 8 VNNI instructions with no horizontal sums, where int8_rows.c sums each
    row's lanes. The same activations rounded the same way; the sums run in another order.
    Taken for the LM head where the CPU has VNNI."""

    kind = "int8-groups"
    tensor_names = ("packed",)

    def _allocate(self) -> None:
        self.packed = torch.empty(lowbit_shape(*self.shape, 8), dtype=torch.uint8)

    def fill(self, start: int, rows: np.ndarray) -> None:
        if start % LOWBIT_GROUP:
            raise ValueError(f"rows are filled from a multiple of {LOWBIT_GROUP}")
        codes, scales = Int8Weight.quantized(_tensor(rows))
        packed = pack_int8_rows(codes.numpy(), scales.float().numpy())
        first = start // LOWBIT_GROUP
        self.packed[first : first + len(packed)] = torch.from_numpy(packed)

    @functools.cached_property
    def _bound(self) -> LowBitProduct:
        return lowbit_rows(8).bind(self.packed.numpy(), self.shape[0])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self._bound(x)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


class Int8BlockWeight(_HostKernel):
    """GGUF Q8_0 and Q6_K weights as the file holds them: signed 8-bit codes (Q6_K's 6-bit
    code minus 32) with a float32 scale per 32 (Q8_0) or per 16 (Q6_K) weights, multiplied
    by runtime/kernels/int8_rows.c over activations rounded to int8 per block of 32, as
    llama.cpp's AVX2 Q8_0 x Q8_0 dot does: 1.125 or 1.25 bytes a weight where fp16 took 2,
    and a row's result the same whatever shares its batch. An RMSNorm weight before it
    multiplies the rows as they are rounded."""

    kind = "int8-blocks"
    fine = False  # the activations rounded in two passes (`Int8BlockHead`)

    def __init__(self, q: BlockCodes, input_scale: np.ndarray | None) -> None:
        self.shape: tuple[int, int] = q.shape
        self.codes = torch.from_numpy(np.ascontiguousarray(q.codes))
        self.scales = torch.from_numpy(np.ascontiguousarray(q.scales, np.float32))
        self.input_scale = _scale(input_scale)

    def saved(self) -> dict[str, torch.Tensor]:
        scale = {} if self.input_scale is None else {"input_scale": self.input_scale}
        return {"codes": self.codes, "scales": self.scales} | scale

    @classmethod
    def restored(cls, shape: tuple[int, int], tensors: dict[str, torch.Tensor]) -> Int8BlockWeight:
        weight = cls.__new__(cls)
        weight.shape, weight.codes, weight.scales = shape, tensors["codes"], tensors["scales"]
        weight.input_scale = tensors.get("input_scale")
        return weight

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        scale = None if self.input_scale is None else self.input_scale.numpy()
        return self.codes.numpy(), self.scales.numpy(), scale

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return int8_rows().blocks(x, *self._arrays, fine=self.fine)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


class Int8BlockHead(Int8BlockWeight):
    """A Q8_0 / Q6_K head from the file's codes, its query rows rounded in two int8 passes
    (what the first misses, rounded again): the same bytes read, twice the integer dots.
    On the AVX2 plan SmolLM2's teacher-forced top-1 against float32 was 98.1% with the fp16
    head (float32 rows), 97.8% with one pass and 98.1% again with two."""

    kind = "int8-blocks-fine"
    fine = True


class Int8BlockGroupWeight(_HostKernel):
    """`Int8BlockWeight`'s codes and scales laid out 16 rows side by side (each code plus
    128; native.py `pack_int8_groups`) for int8_rows.c's `llmq_int8_groups`: an activation
    block meets 16 weight rows in 8 VNNI instructions (512-bit with AVX-512) or llama.cpp's
    AVX2 sign trick, with no horizontal sums. The same bytes read (rows padded to 16), the
    same rounded activations; each row's sum in its own fixed order, so a row's result does
    not depend on its batch. bench/int8_layouts.py: 3.7-4.3x `Int8BlockWeight` at 480 rows
    and 1.4-2.0x at one on an AMX Xeon (1.8x / 1.2-1.4x with the AVX2 build there)."""

    kind = "int8-block-groups"
    fine = False  # the activations rounded in two passes (`Int8BlockGroupHead`)

    def __init__(self, q: BlockCodes, input_scale: np.ndarray | None) -> None:
        self.shape: tuple[int, int] = q.shape
        packed, scales = pack_int8_groups(q.codes, np.asarray(q.scales, np.float32))
        self.packed, self.scales = torch.from_numpy(packed), torch.from_numpy(scales)
        self.input_scale = _scale(input_scale)

    def saved(self) -> dict[str, torch.Tensor]:
        scale = {} if self.input_scale is None else {"input_scale": self.input_scale}
        return {"packed": self.packed, "scales": self.scales} | scale

    @classmethod
    def restored(
        cls, shape: tuple[int, int], tensors: dict[str, torch.Tensor]
    ) -> Int8BlockGroupWeight:
        weight = cls.__new__(cls)
        weight.shape, weight.packed, weight.scales = shape, tensors["packed"], tensors["scales"]
        weight.input_scale = tensors.get("input_scale")
        return weight

    @functools.cached_property
    def _bound(self) -> Int8GroupsProduct:
        scale = None if self.input_scale is None else self.input_scale.numpy()
        packed, scales = self.packed.numpy(), self.scales.numpy()
        return int8_rows().bind_groups(packed, scales, self.shape[0], scale)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self._bound(x, fine=self.fine)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes


class Int8BlockGroupHead(Int8BlockGroupWeight):
    """`Int8BlockHead`'s two rounding passes over the grouped layout."""

    kind = "int8-block-groups-fine"
    fine = True


# the types whose codes a 4-bit index into one of int8_rows.c's nibble tables holds
NIBBLE_TABLE_OF = {Q.IQ4_NL: "iq4", Q.IQ4_XS: "iq4", Q.MXFP4: "mxfp4", Q.Q3_K: "signed4"}
NIBBLE_TABLE_OF[Q.Q2_K] = "signed4"  # its codes 0..3 (TwoBitWeight)
NIBBLE_TABLE_NAMES = tuple(dict.fromkeys(NIBBLE_TABLE_OF.values()))


def nibble_table(types: set) -> str:
    """The one nibble table that holds every code of `types` ("" for none, or none that
    builds here): IQ4_NL / IQ4_XS, MXFP4, and Q3_K / Q2_K keep 4 bits a code where the
    8-bit layout took 8."""
    tables = {NIBBLE_TABLE_OF.get(t) for t in types}
    table = tables.pop() if len(tables) == 1 else None
    return table if table is not None and nibble_rows(table) is not None else ""


class NibbleGroupWeight(Int8BlockGroupWeight):
    """`Int8BlockGroupWeight` with each code held as its 4-bit index into a table of int8
    values (native.py `pack_nibble_groups`, int8_rows.c's NIBBLE_TABLE builds): IQ4_NL,
    IQ4_XS and MXFP4 (their own value tables) and Q3_K / Q2_K (signed 4-bit codes) at half
    the bytes, multiplied to the same numbers bitwise (the shuffle through the table gives
    the 8-bit layout's codes)."""

    kind = "nibble-block-groups"

    def __init__(self, q: BlockCodes, table: str, input_scale: np.ndarray | None) -> None:
        self.shape: tuple[int, int] = q.shape
        self.table = table
        packed, scales = pack_nibble_groups(q.codes, np.asarray(q.scales, np.float32), table)
        self.packed, self.scales = torch.from_numpy(packed), torch.from_numpy(scales)
        self.input_scale = _scale(input_scale)

    def saved(self) -> dict[str, torch.Tensor]:
        table = torch.tensor([NIBBLE_TABLE_NAMES.index(self.table)], dtype=torch.uint8)
        return super().saved() | {"table": table}

    @classmethod
    def restored(cls, shape: tuple[int, int], tensors: dict[str, torch.Tensor]):
        weight = super().restored(shape, tensors)
        weight.table = NIBBLE_TABLE_NAMES[int(tensors["table"][0])]
        return weight

    @functools.cached_property
    def _bound(self) -> Int8GroupsProduct:
        scale = None if self.input_scale is None else self.input_scale.numpy()
        packed, scales = self.packed.numpy(), self.scales.numpy()
        return nibble_rows(self.table).bind_groups(packed, scales, self.shape[0], scale)


class NibbleGroupHead(NibbleGroupWeight):
    """`Int8BlockHead`'s two rounding passes over 4-bit indices."""

    kind = "nibble-block-groups-fine"
    fine = True


class TwoBitWeight(_HostKernel):
    """GGUF Q2_K from its codes: `d * scale * code - dmin * min` per 16 weights. The codes
    times their scales go to int8_rows.c as a Q6_K's would (`codes`: the plan's 8-bit
    layout); the mins meet each 16 activations' sum, as llama.cpp's Q2_K dot meets them
    with its Q8_K block sums: the sums `[T, K/16]` (in one fixed order per row) multiply
    the 4-bit min codes with -dmin per 16 of them through int8_rows.c again, rounded in two
    int8 passes (~15 bits). Each row's result is its own: both products and the sums are."""

    kind = "two-bit-blocks"
    fine = False  # the codes' activations rounded in two passes (`TwoBitHead`)

    def __init__(self, q: TwoBitCodes, grouped: bool, input_scale: np.ndarray | None) -> None:
        self.shape: tuple[int, int] = q.shape
        if grouped and nibble_table({Q.Q2_K}):
            self.codes = NibbleGroupWeight(q.codes, nibble_table({Q.Q2_K}), input_scale)
        else:
            layout = Int8BlockGroupWeight if grouped else Int8BlockWeight
            self.codes = layout(q.codes, input_scale)
        n, sums = q.min_codes.shape
        width = -(-sums // GROUP_SIZE) * GROUP_SIZE  # int8_rows.c takes whole blocks of 32
        min_codes = np.zeros((n, width), np.int8)
        min_codes[:, :sums] = q.min_codes
        dmin = np.zeros((n, width // 16), np.float32)
        dmin[:, : q.dmin.shape[1]] = -q.dmin
        self.mins = Int8BlockHead(BlockCodes(min_codes, dmin), None)
        self.input_scale = _scale(input_scale)

    def saved(self) -> dict[str, torch.Tensor]:
        codes = {f"codes.{key}": t for key, t in self.codes.saved().items()}
        return (
            codes
            | {"mins.codes": self.mins.codes, "mins.scales": self.mins.scales}
            | ({} if self.input_scale is None else {"input_scale": self.input_scale})
        )

    @classmethod
    def restored(cls, shape: tuple[int, int], tensors: dict[str, torch.Tensor]) -> TwoBitWeight:
        weight = cls.__new__(cls)
        weight.shape, weight.input_scale = shape, tensors.get("input_scale")
        codes = {key[6:]: t for key, t in tensors.items() if key.startswith("codes.")}
        layout = Int8BlockGroupWeight if "packed" in codes else Int8BlockWeight
        layout = NibbleGroupWeight if "table" in codes else layout
        if cls.fine:  # the codes' rows rounded in two passes too (`TwoBitHead`)
            layout = {
                Int8BlockGroupWeight: Int8BlockGroupHead,
                Int8BlockWeight: Int8BlockHead,
                NibbleGroupWeight: NibbleGroupHead,
            }[layout]
        weight.codes = layout.restored(shape, codes)
        mins = {"codes": tensors["mins.codes"], "scales": tensors["mins.scales"]}
        weight.mins = Int8BlockHead.restored(tuple(mins["codes"].shape), mins)
        return weight

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        rows, k = x.shape
        scaled = x if self.input_scale is None else x * self.input_scale.numpy()
        sums = np.zeros((rows, self.mins.shape[1]), np.float32)
        sums[:, : k // 16] = scaled.reshape(rows, k // 16, 16).sum(axis=2, dtype=np.float32)
        out = self.codes(x)
        out += self.mins(sums)
        return out

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.mins.nbytes


class TwoBitHead(TwoBitWeight):
    """A Q2_K head: `Int8BlockHead`'s two rounding passes for the codes' rows too."""

    kind = "two-bit-blocks-fine"
    fine = True


class StackedWeight(_Product):
    """A fused weight whose parts take different kernels (Gemma 3's q and k are Q5_0, its v
    Q6_K): each run of parts is its own weight, and their outputs are set side by side."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.kind = "+".join(p.kind for p in parts)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate([p(x) for p in self.parts], axis=1)  # [T, K] -> [T, sum N]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.product(x) for p in self.parts], dim=1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class RescoredHead(_Product):
    """An int4 copy of a head that ranks, then the file's own rows for each query's best
    `RESCORED_ROWS` (see RESCORED_ROWS). Every query row is done alone, in the same order
    of arithmetic, so its logits do not depend on what shares its batch. The ranking is
    what a load prepares and keeps; the exact rows are read from the mapped file by
    `rows` (`GGUFFile.rows` of the head), which `TorchBackend.head` binds."""

    kind = "int4+rescore"

    def __init__(self, ranking: _Product, rows: Callable[[np.ndarray], np.ndarray]) -> None:
        self.shape = ranking.shape
        self.ranking = ranking
        self.rows = rows

    @classmethod
    def ranking_of(cls, f: GGUFFile, name: str, native: bool) -> Int4Weight | LowBitWeight:
        """The int4 ranking built a chunk of rows at a time (no float32 copy of the head):
        lowbit_rows.c's layout where `native` (Gemma 3's 262k-row head ranked 1 / 32 rows in
        3.1 / 49 ms where torch's int4 took 4.7 / 66, on an AVX512-BF16 EPYC), else
        torch's."""
        rows, cols = (int(d) for d in f.blocks(name)[2])
        packed = repack.ranking(f, name) if native else None  # repack.c: the same, one pass
        if packed is not None:
            return RescoredBlockRanking.restored((rows, cols), {"packed": torch.from_numpy(packed)})
        starts = range(0, rows, HEAD_CHUNK_ROWS)
        chunks = (quantize_groups(f.rows(name, slice(s, s + HEAD_CHUNK_ROWS))) for s in starts)
        if not native:
            ranking = Int4Weight.stacked([Int4Weight(q, None) for q in chunks])
            return RescoredRanking.from_int4(ranking)
        packed = np.concatenate([pack_lowbit(q, 4) for q in chunks])  # whole groups, but the last
        return RescoredBlockRanking.restored((rows, cols), {"packed": torch.from_numpy(packed)})

    def product(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.ranking.product(x)
        best = torch.topk(logits, min(RESCORED_ROWS, self.shape[0]), dim=1).indices.numpy()
        queries = x.double().numpy()
        exact = np.empty(best.shape, np.float64)
        for t, ids in enumerate(best):
            rows = self.rows(ids).astype(np.float64)
            exact[t] = (rows * queries[t]).sum(axis=1)  # each row's own pairwise sum
        logits.scatter_(1, torch.from_numpy(best), torch.from_numpy(exact).float())
        return logits

    @property
    def nbytes(self) -> int:
        return self.ranking.nbytes


class Bf16Weight(_RowStore):
    kind = "bf16"
    tensor_names = ("weight",)

    def _allocate(self) -> None:
        self.weight = torch.empty(self.shape, dtype=torch.bfloat16)

    def fill(self, start: int, rows: np.ndarray) -> None:
        self.weight[start : start + len(rows)] = _tensor(rows).to(torch.bfloat16)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).float()

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class Fp16RowsWeight(_HostKernel, _RowStore):
    """fp16 weights multiplied by runtime/kernels/dense_rows.c: each output one row's own
    sum in a fixed order, where fbgemm's fp16 gemm rounds a row differently with the rows
    beside it on AVX2. For the weights a file holds as F16/BF16/F32 (and types no integer
    kernel takes) on the row-invariant AVX2 plan."""

    kind = "fp16-rows"
    tensor_names = ("weight",)

    def _allocate(self) -> None:
        self.weight = torch.empty(self.shape, dtype=torch.float16)

    def fill(self, start: int, rows: np.ndarray) -> None:
        self.weight[start : start + len(rows)] = _tensor(rows).to(torch.float16)

    @functools.cached_property
    def _half(self) -> np.ndarray:
        return self.weight.numpy()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return dense_rows().fp16(x, self._half)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class Fp16Weight(_Product):
    """float16 weights multiplied with float32 activations by fbgemm's packed fp16 gemm: it
    converts weights in registers (F16C), so it runs at AVX2's float32 speed from half the
    bytes, where bf16 products without AVX512-BF16 convert in software (5-8x slower)."""

    kind = "fp16"

    def __init__(self, dense: np.ndarray) -> None:
        self.shape: tuple[int, int] = dense.shape
        self.packed = torch.ops.quantized.linear_prepack_fp16(_tensor(dense), None)
        self._nbytes = 2 * dense.size

    def saved(self) -> dict[str, torch.Tensor]:
        """The fp16 values fbgemm packed (its packed form does not serialize)."""
        weight, _ = torch.ops.quantized.linear_unpack_fp16(self.packed)
        return {"weight": weight.to(torch.float16)}

    @classmethod
    def restored(cls, shape: tuple[int, int], tensors: dict[str, torch.Tensor]) -> Fp16Weight:
        weight = cls(tensors["weight"].float().numpy())  # fp16 values pack back exactly
        pages.release_array(tensors["weight"])  # fbgemm holds its own packed copy now
        return weight

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)

    @property
    def nbytes(self) -> int:
        return self._nbytes


@functools.cache
def _give_torch_the_cores(threads: int) -> None:
    """Once per process. torch's OpenMP threads and OpenBLAS's (numpy's attention matmuls)
    both spin on the same cores after their work: Gemma 3 at 540 tokens of context decoded
    3.3 tok/s with both at 2 threads and 24.9 with OpenBLAS at 1."""
    torch.set_num_threads(threads)
    threadpoolctl.threadpool_limits(1, user_api="blas")
    share_cores(threads, torch.set_num_threads)  # fewer while other processes hold cores


def int8_row_error(dense: np.ndarray) -> float:
    """99th percentile over rows of |requantized - dense| / |dense| (RMS) for int8 per row."""
    t = _tensor(np.ascontiguousarray(dense, np.float32))
    scales = (t.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127).to(torch.bfloat16).float()
    error = torch.linalg.vector_norm(torch.round(t / scales).clamp(-127, 127) * scales - t, dim=1)
    relative = error / torch.linalg.vector_norm(t, dim=1).clamp_min(1e-30)
    return float(torch.quantile(relative, 0.99))


class BlockEmbedding:
    """Embedding rows dequantized from the file's own blocks on lookup: the table stays in
    the mapped file, and only the rows a step uses are ever turned into floats."""

    def __init__(self, f: GGUFFile, name: str) -> None:
        self.file, self.name = f, name
        blocks, _, shape = f.blocks(name)
        self.shape: tuple[int, int] = (shape[0], shape[1])
        self._nbytes = int(blocks.nbytes)
        f.rows(name, slice(0, 1))  # a type gguf cannot dequantize fails at load, not later

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return self.file.rows(self.name, np.asarray(tokens))

    @property
    def nbytes(self) -> int:
        return self._nbytes


class RescoredRanking(Int4Weight):
    """A rescored head's int4 ranking as the store keeps it: its own kind, so that a load
    that maps it knows to rescore without measuring the head again."""

    kind = RescoredHead.kind

    @classmethod
    def from_int4(cls, weight: Int4Weight) -> RescoredRanking:
        return cls.restored(weight.shape, weight.saved())


class RescoredBlockRanking(LowBitWeight):
    """A rescored head's ranking in lowbit_rows.c's layout, as the store keeps it."""

    kinds = {4: "int4-blocks+rescore"}


RESCORED_KINDS = (RescoredRanking.kind, RescoredBlockRanking.kinds[4])
# heads multiplied by a copy cheaper than the file's codes, which only a greedy row may use:
# against float32 products of the dequantized head, SmolLM2's Q8_0 head requantized to
# int8 per row was off by up to 0.25 in its top 8 and 0.76 past them (one argmax of 15
# changed), Gemma 3's ranked one by 1.2 at ranks 9-32 and 2.4 past them
# (bench/head_precision.py)
CHEAPER_HEAD_KINDS = (Int8Weight.kind, Int8GroupWeight.kind, RescoredHead.kind)


class FileHead:
    """A head's product at the file's precision (`TorchBackend._file_head`: for Q8_0 the
    file's codes through int8_rows.c, the activations rounded in two int8 passes), beside
    a head the plan multiplies by a cheaper copy (`CHEAPER_HEAD_KINDS`): what the rows
    whose logits a user sees or samples from take (runtime/models/base.py
    `DecoderModel.logits`, `exact`). Built from the mapped file on its first call, so a
    server that only decodes greedily never holds it (Gemma 3's: 189 MB)."""

    def __init__(self, build: Callable[[], _Product]) -> None:
        self._build = build

    @functools.cached_property
    def weight(self) -> _Product:
        return self._build()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.weight(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.product(x)


WEIGHT_CLASSES = {
    c.kind: c
    for c in (
        Int4Weight,
        Int8Weight,
        Int8GroupWeight,
        Int8BlockWeight,
        Int8BlockHead,
        Int8BlockGroupWeight,
        Int8BlockGroupHead,
        NibbleGroupWeight,
        NibbleGroupHead,
        TwoBitWeight,
        TwoBitHead,
        Bf16Weight,
        Fp16Weight,
        Fp16RowsWeight,
        RescoredRanking,
    )
} | {kind: c for c in (LowBitWeight, RescoredBlockRanking) for kind in c.kinds.values()}


class TorchBackend:
    name = "torch"

    def __init__(self, plan: KernelPlan | None = None, *, native_lowbit: bool = True) -> None:
        """`native_lowbit=False` keeps torch's kernels for 4- and 5-bit weights even where
        lowbit_rows.c builds (tests and benches compare the two)."""
        self.plan = plan or default_plan()
        self._allow_native = native_lowbit
        _give_torch_the_cores(self.plan.threads)
        self.prepared: PreparedWeights | None = None  # while a model file loads

    @property
    def kv_dtype(self) -> np.dtype:
        """The host path's KV pool element type on this plan (runtime/models/ops.py)."""
        return np.dtype(self.plan.kv)

    def describe_kept(self, qtype) -> str:
        """How a weight of `qtype` is kept and multiplied (`llmq models`, the load log)."""
        return torch_kept_as(self, qtype)

    @contextlib.contextmanager
    def loading(self, f: GGUFFile) -> Iterator[None]:
        """A model's weights are built inside this: those an earlier load of the same file
        and plan prepared are mapped from LLMQ_CACHE_DIR (kernels/prepared.py), and the rest
        are saved there for the next load once the model is whole."""
        log_types(f, self)  # each type and its kernel; those held dequantized by name
        self.prepared = PreparedWeights.for_file(f, self.describe())
        try:
            yield
            if self.prepared is not None:
                self.prepared.save()
        finally:
            self.prepared = None

    def linear(self, f: GGUFFile, parts: list[TensorPart], input_scale: np.ndarray | None = None):
        runs = self._runs(f, parts)
        if len(runs) > 1:  # each run kept and reused on its own
            return StackedWeight([self.linear(f, run, input_scale) for run in runs])
        key = weight_key(parts, input_scale) if self.prepared is not None else ""
        weight = self._reused(key)
        if weight is None:
            weight = self._kept(key, self._build(f, parts, input_scale))
            for part in parts:  # built into its own memory: the file's pages are dead
                pages.release_array(f.blocks(part.name)[0])
        return weight

    def _family(self, qtype) -> str:
        """Which native kernel a tensor of `qtype` goes to on this plan ("" for none)."""
        if self.native_lowbit and qtype in FOUR_BIT_TYPES | FIVE_BIT_TYPES:
            return "lowbit"
        if self.native_eight_bit and qtype in EIGHT_BIT_TYPES:
            return "int8-blocks"
        if self.native_eight_bit and qtype in TWO_BIT_TYPES:
            return TwoBitWeight.kind
        return ""

    def _runs(self, f: GGUFFile, parts: list[TensorPart]) -> list[list[TensorPart]]:
        """`parts` in runs of one kernel each, where the plan multiplies the 8-bit types from
        their codes (else one run: the plan's mixed types go dense together)."""
        if not self.native_eight_bit:
            return [parts]
        runs: list[list[TensorPart]] = []
        families = [self._family(f.blocks(p.name)[1]) for p in parts]
        for i, part in enumerate(parts):
            if i and families[i] == families[i - 1]:
                runs[-1].append(part)
            else:
                runs.append([part])
        return runs

    def _build(self, f: GGUFFile, parts: list[TensorPart], input_scale: np.ndarray | None):
        types = {f.blocks(p.name)[1] for p in parts}
        repacked = self._repacked(f, parts, types, input_scale)
        if repacked is not None:
            return repacked
        if self.native_eight_bit and types <= EIGHT_BIT_TYPES:
            fused = BlockCodes.concat([block_part(f, p) for p in parts])
            if self.plan.eight_bit == Int8BlockGroupWeight.kind and nibble_table(types):
                return NibbleGroupWeight(fused, nibble_table(types), input_scale)
            if self.plan.eight_bit == Int8BlockGroupWeight.kind:
                return Int8BlockGroupWeight(fused, input_scale)
            return Int8BlockWeight(fused, input_scale)
        if self.native_eight_bit and types <= TWO_BIT_TYPES:
            two_bit = TwoBitCodes.concat([two_bit_part(f, p) for p in parts])
            grouped = self.plan.eight_bit == Int8BlockGroupWeight.kind
            return TwoBitWeight(two_bit, grouped, input_scale)
        four_bit = types <= FOUR_BIT_TYPES
        lowbit = self.native_lowbit and types <= FOUR_BIT_TYPES | FIVE_BIT_TYPES
        if lowbit or (four_bit and self.plan.four_bit == "int4"):
            fused = GroupQuantized.concat([group_part(f, p) for p in parts])
            if lowbit:
                return LowBitWeight(fused, 4 if four_bit else 5, input_scale)
            return Int4Weight(fused, input_scale)
        if four_bit:  # torch's threads dequantize nibbles 3x faster than gguf's numpy
            dense = torch.cat([dequantize_groups(group_part(f, p)) for p in parts]).numpy()
        else:
            dense = np.concatenate([p.dense(f) for p in parts], axis=0, dtype=np.float32)
        if input_scale is not None:  # dense stores fold it into the columns, as numpy does
            dense *= input_scale[None, :]
        return self._dense(self.plan.four_bit if four_bit else self.plan.other, dense)

    def _repacked(self, f: GGUFFile, parts: list[TensorPart], types: set, input_scale):
        """The weight `_build` would make, packed by runtime/kernels/repack.c straight from
        the file's blocks (bitwise the same, one pass); None where it takes another path."""
        shape = (
            sum(int(f.blocks(p.name)[2][0]) for p in parts),
            int(f.blocks(parts[0].name)[2][1]),
        )
        scale = {} if input_scale is None else {"input_scale": _scale(input_scale)}
        grouped = self.plan.eight_bit == Int8BlockGroupWeight.kind
        if (
            self.native_eight_bit
            and grouped
            and types <= EIGHT_BIT_TYPES
            and not nibble_table(types)
        ):
            done = repack.int8_groups(f, parts)
            if done is not None:
                tensors = {"packed": torch.from_numpy(done[0]), "scales": torch.from_numpy(done[1])}
                return Int8BlockGroupWeight.restored(shape, tensors | scale)
        if self.native_lowbit and types == {Q.Q4_K}:
            packed = repack.q4k_lowbit(f, parts)
            if packed is not None:
                return LowBitWeight.restored(shape, {"packed": torch.from_numpy(packed)} | scale)
        return None

    def embedding(self, f: GGUFFile, name: str) -> BlockEmbedding:
        return BlockEmbedding(f, name)

    def head(self, f: GGUFFile, name: str, tied: object | None = None):
        key = f"head:{name}"
        head = self._reused(key)
        if head is None:
            head = self._kept(key, self._build_head(f, name))
            # every row was read to build it; lookups and rescoring read theirs back alone
            pages.release_array(f.blocks(name)[0])
        if head.kind in RESCORED_KINDS:  # kept as its int4 ranking (`WEIGHT_CLASSES`)
            head = RescoredHead(head, functools.partial(f.rows, name))
        if head.kind in CHEAPER_HEAD_KINDS:  # the rows a user sees take the file's product
            head.full = FileHead(functools.partial(self._file_head, f, name))
        return head

    def _build_head(self, f: GGUFFile, name: str):
        """int8 and bf16 heads are filled a chunk of rows at a time, so no float32 copy of
        the whole head exists (fbgemm packs fp16 from one float32 tensor); a rescored head
        is built as its ranking."""
        kind = self._head_kind(f, name)
        return self._file_head(f, name) if kind == "file" else self._head_of_kind(f, name, kind)

    def _file_head(self, f: GGUFFile, name: str):
        """The head multiplied as a layer weight of its type would be: Q8_0 / Q6_K from
        their codes (two rounding passes), 4- and 5-bit through lowbit_rows.c, the rest as
        the plan's dense kind; the "file" head kind, and every cheaper head's `full`."""
        if self._family(f.blocks(name)[1]):
            head = self._build(f, [TensorPart(name)], None)
            if isinstance(head, Int8BlockWeight):
                return Int8BlockHead.restored(head.shape, head.saved())
            if isinstance(head, TwoBitWeight):  # a Q2_K head
                return TwoBitHead.restored(head.shape, head.saved())
            if isinstance(head, NibbleGroupWeight):  # an IQ4 / MXFP4 / Q3_K head
                return NibbleGroupHead.restored(head.shape, head.saved())
            if isinstance(head, Int8BlockGroupWeight):
                return Int8BlockGroupHead.restored(head.shape, head.saved())
            return head
        return self._head_of_kind(f, name, self._dense_kind(self.plan.other, f.blocks(name)[2][1]))

    def _head_of_kind(self, f: GGUFFile, name: str, kind: str):
        if kind == "fp16":
            return Fp16Weight(f.tensor(name))
        if kind == RescoredHead.kind:
            return RescoredHead.ranking_of(f, name, self.native_lowbit)
        shape = f.blocks(name)[2]
        packed = repack.int8_head(f, name) if kind == "int8" and self.grouped_int8 else None
        if packed is not None:  # runtime/kernels/repack.c: the same bytes in one pass
            return Int8GroupWeight.restored(
                (int(shape[0]), int(shape[1])), {"packed": torch.from_numpy(packed)}
            )
        int8 = Int8GroupWeight if self.grouped_int8 else Int8Weight
        head = {"int8": int8, "fp16-rows": Fp16RowsWeight}.get(kind, Bf16Weight)(shape)
        for start in range(0, shape[0], HEAD_CHUNK_ROWS):
            head.fill(start, f.rows(name, slice(start, start + HEAD_CHUNK_ROWS)))
        return head

    def _reused(self, key: str):
        """The weight an earlier load prepared under `key`, if the store has it."""
        saved = self.prepared.get(key) if self.prepared is not None else None
        if saved is None:
            return None
        return WEIGHT_CLASSES[saved.kind].restored(saved.shape, saved.tensors)

    def _kept(self, key: str, weight):
        if self.prepared is not None:
            self.prepared.add(key, SavedWeight(weight.kind, weight.shape, weight.saved()))
        return weight

    @property
    def native_lowbit(self) -> bool:
        """Whether 4- and 5-bit weights go to runtime/kernels/lowbit_rows.c: on the int4
        plans, where it builds (else torch's int4, and 5-bit as the plan's other kind)."""
        return self.plan.four_bit == "int4" and self._allow_native and lowbit_builds()

    @property
    def native_eight_bit(self) -> bool:
        """Whether Q8_0 and Q6_K weights go to runtime/kernels/int8_rows.c as the file's own
        codes (the plan's `eight_bit`, where it builds; else the plan's `other` kind)."""
        return (
            self.plan.eight_bit in (Int8BlockWeight.kind, Int8BlockGroupWeight.kind)
            and self._allow_native
            and int8_rows() is not None
        )

    @property
    def grouped_int8(self) -> bool:
        """Whether an int8 head goes to lowbit_rows.c's 8-bit build (CPUs with VNNI)."""
        return self.plan.head == "int8" and self._allow_native and lowbit_rows(8) is not None

    def describe(self) -> dict[str, str]:
        described = {"cpu": cpu_features().level, **self.plan.describe()}
        if self.grouped_int8:  # the large head's kind kept: the prepared store keys by this
            large = described["lm head"].partition(";")[2]
            described["lm head"] = f"int8 (lowbit_rows.c) (else {self.plan.head_fallback})"
            described["lm head"] += f";{large}" if large else ""
        if self.native_lowbit:
            described["4-bit weights"] = "int4 (lowbit_rows.c, int8 activations)"
            described["5-bit weights"] = "int5 (lowbit_rows.c, int8 activations)"
        elif self.plan.four_bit == "int4":
            described["4-bit weights"] = "int4 (torch, bf16 activations)"
        if self.native_eight_bit:
            grouped = self.plan.eight_bit == Int8BlockGroupWeight.kind
            layout = ", 16 rows side by side" if grouped else ""
            described["8-bit weights"] = (
                f"{' / '.join(sorted(t.name for t in EIGHT_BIT_TYPES))} codes "
                f"(int8_rows.c{layout}, int8 rows)"
            )
            described["2-bit weights"] = "Q2_K codes and mins (int8_rows.c, int8 rows)"
        return described

    def stored_bytes(self, f: GGUFFile, name: str, role: str) -> int:
        blocks, qtype, shape = f.blocks(name)
        n = int(np.prod(shape))
        if role == "embedding":
            return int(blocks.nbytes)
        if role in ("head", "tied head"):
            kind = self._head_kind(f, name)
            if kind == "file" and self._family(qtype):
                return self.stored_bytes(f, name, "linear")
            if kind == "int8" and self.grouped_int8:
                return int(np.prod(lowbit_shape(shape[0], shape[1], 8)))
            if kind == "int8":
                return n + 2 * shape[0]  # codes and a bf16 scale per row
            if kind == RescoredHead.kind:  # nibbles, a bf16 scale and zero a group
                return n // 2 + 4 * (n // GROUP_SIZE)
            return 2 * n
        if role != "linear":
            return 4 * n
        if qtype in FOUR_BIT_TYPES and self.plan.four_bit == "int4":
            return n // 2 + 4 * (n // GROUP_SIZE)  # nibbles, then two halves a group
        if qtype in FIVE_BIT_TYPES and self.native_lowbit:
            return 5 * n // 8 + 4 * (n // GROUP_SIZE)  # nibbles and fifth bits, two halves
        two_bit = qtype in TWO_BIT_TYPES
        if (qtype in EIGHT_BIT_TYPES or two_bit) and self.native_eight_bit:
            # codes, a float32 per 32 or 16 (Q2_K: and its min codes, a float32 per 256)
            mins = -(-shape[1] // 512) * 32 * shape[0] * 5 // 4 if two_bit else 0
            grouped = self.plan.eight_bit == Int8BlockGroupWeight.kind
            if grouped:  # rows padded to 16
                n = -(-shape[0] // INT8_GROUP) * INT8_GROUP * shape[1]
            per_16 = qtype in PER_16_TYPES or two_bit
            codes = n // 2 if grouped and nibble_table({qtype}) else n  # 4-bit indices
            return codes + 4 * (n // (16 if per_16 else GROUP_SIZE)) + mins
        return 2 * n

    def _head_kind(self, f: GGUFFile, name: str) -> str:
        """The plan's head kind (its `large_head` for a head of over LARGE_HEAD_ROWS rows);
        for int8, only if the head's first rows allow it."""
        if self.plan.large_head and f.blocks(name)[2][0] > LARGE_HEAD_ROWS:
            return self.plan.large_head
        if self.plan.head != "int8":
            return self.plan.head
        if int8_row_error(f.rows(name, slice(0, HEAD_CHUNK_ROWS))) <= MAX_INT8_ROW_ERROR:
            return "int8"
        return self.plan.head_fallback

    def _dense_kind(self, kind: str, in_features: int) -> str:
        """`kind`, but fbgemm's fp16 where dense_rows.c cannot take it (no compiler, K not a
        multiple of 8, or the tensor forward pass, which keeps torch's kernels)."""
        if kind != "fp16-rows":
            return kind
        kernel = dense_rows() if self._allow_native else None
        return kind if kernel is not None and kernel.accepts(in_features) else "fp16"

    def _dense(self, kind: str, dense: np.ndarray):
        kind = self._dense_kind(kind, dense.shape[1])
        if kind == "bf16":
            return Bf16Weight.from_dense(dense)
        if kind == "fp16":
            return Fp16Weight(dense)
        if kind == "fp16-rows":
            return Fp16RowsWeight.from_dense(dense)
        raise ValueError(f"unknown dense kernel {kind!r}")


def dequantize_groups(q: GroupQuantized) -> torch.Tensor:
    """float32 `[N, K]` from group-wise codes, scales and mins."""
    n, k = q.shape
    codes = torch.from_numpy(q.codes).view(n, k // GROUP_SIZE, GROUP_SIZE).float()
    codes.mul_(torch.from_numpy(q.scales)[..., None]).add_(torch.from_numpy(q.mins)[..., None])
    return codes.view(n, k)


def _read_part(f: GGUFFile, part: TensorPart, read):
    """One tensor's blocks as `read(blocks, qtype, (N, K))` gives them, with the part's row
    order and scale applied."""
    blocks, qtype, shape = f.blocks(part.name)
    q = read(blocks, qtype, (shape[0], shape[1]))
    if part.row_order is not None:
        q = q.take_rows(part.row_order)
    return q.scaled(part.scale) if part.scale != 1.0 else q


def block_part(f: GGUFFile, part: TensorPart) -> BlockCodes:
    """One Q8_0 / Q6_K tensor's codes and scales with the part's row operations applied."""
    return _read_part(f, part, read_eight_bit)


def two_bit_part(f: GGUFFile, part: TensorPart) -> TwoBitCodes:
    """One Q2_K tensor's codes, scales and mins with the part's row operations applied."""
    return _read_part(f, part, read_two_bit)


def _read_group(blocks: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupQuantized:
    read = read_five_bit if qtype in FIVE_BIT_TYPES else read_four_bit
    return read(blocks, qtype, shape)


def group_part(f: GGUFFile, part: TensorPart) -> GroupQuantized:
    """One 4- or 5-bit tensor's codes, scales and mins with the part's row operations
    applied."""
    return _read_part(f, part, _read_group)
