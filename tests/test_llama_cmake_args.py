"""The llama.cpp build flags follow the CPU's flags (bench/llama_cmake_args.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "llama_cmake_args.py"
spec = importlib.util.spec_from_file_location("llama_cmake_args", SCRIPT)
llama_cmake_args = importlib.util.module_from_spec(spec)
spec.loader.exec_module(llama_cmake_args)

ZEN3_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 vaes
"""


def test_avx2_cpu_gets_no_avx512_and_never_amx() -> None:
    args = llama_cmake_args.cmake_args(llama_cmake_args.cpu_flags(ZEN3_CPUINFO))
    assert "-DGGML_NATIVE=OFF" in args
    assert "-DGGML_AVX2=ON" in args and "-DGGML_FMA=ON" in args
    assert "-DGGML_AVX512=OFF" in args and "-DGGML_AVX512_VNNI=OFF" in args
    assert "-DGGML_AMX_INT8=OFF" in args


def test_avx512_cpu_with_amx_gets_avx512_but_not_amx() -> None:
    flags = llama_cmake_args.cpu_flags(ZEN3_CPUINFO) | {
        "avx512f",
        "avx512_vnni",
        "amx_int8",
        "amx_tile",
    }
    args = llama_cmake_args.cmake_args(flags)
    assert "-DGGML_AVX512=ON" in args and "-DGGML_AVX512_VNNI=ON" in args
    assert "-DGGML_AVX512_BF16=OFF" in args
    assert "-DGGML_AMX_TILE=OFF" in args and "-DGGML_AMX_INT8=OFF" in args


def test_cpu_without_x86_flags_builds_native() -> None:
    assert llama_cmake_args.cmake_args(llama_cmake_args.cpu_flags("flags : fp asimd")) == [
        "-DGGML_NATIVE=ON"
    ]


def test_vbmi_follows_the_flag_linux_prints() -> None:
    """/proc/cpuinfo names VBMI `avx512vbmi` (and VBMI2 `avx512_vbmi2`): a CPU with VBMI
    gets GGML_AVX512_VBMI, one with only VBMI2 does not."""
    avx512 = llama_cmake_args.cpu_flags(ZEN3_CPUINFO) | {"avx512f"}
    with_vbmi = llama_cmake_args.cmake_args(avx512 | {"avx512vbmi", "avx512_vbmi2"})
    assert "-DGGML_AVX512_VBMI=ON" in with_vbmi
    assert "-DGGML_AVX512_VBMI=OFF" in llama_cmake_args.cmake_args(avx512 | {"avx512_vbmi2"})
