"""The CUDA sources compile with nvcc for sm_80 and sm_90, for every dtype, exactly as the backend asks NVRTC
to instantiate them; and the Python side agrees with the sources on geometry and argument types.

The nvcc runs need only the CUDA toolkit, no GPU; they are skipped where nvcc is absent. They compile the
text ``load_source`` produces (what CuPy hands NVRTC) plus the backend's name expressions, device code only
(``-cubin``), and fail on any compiler warning too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels_cupy import kernels as K

NVCC = shutil.which("nvcc")
ARCHS = ("sm_80", "sm_90")
# (head_dim, block_size, heads_per_cta): SmolLM2 (64, GQA 3), Llama/Mistral (128, GQA 4), MHA (128, 1).
MODEL_CONFIGS = ((64, 16, 3), (128, 16, 4), (128, 16, 1))
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")


# (query/output dtype, KV cache dtype): the model's dtype throughout, and a 16-bit cache under an fp32 model.
DTYPE_PAIRS = [(t, t) for t in K.SUPPORTED_DTYPES] + [("float32", "bfloat16"), ("float32", "float16")]


def expressions(filename: str, dtypes: tuple[str, str], configs: tuple[tuple[int, int, int], ...]) -> tuple[str, ...]:
    qdt, kvdt = dtypes
    exprs = [e for d, bs, qh in configs for e in K.KernelConfig(kvdt, d, bs, qh, qdt).file_expressions(filename)]
    return tuple(dict.fromkeys(exprs))


def nvcc(workdir: Path, tag: str, filename: str, exprs: tuple[str, ...], arch: str) -> subprocess.CompletedProcess[str]:
    src = workdir / f"{tag}.cu"
    src.write_text(K.instantiation_unit(filename, exprs))
    cmd = [str(NVCC), f"-arch={arch}", "-std=c++17", "-cubin", "-o", str(workdir / f"{tag}.cubin"), str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


Job = tuple[str, tuple[str, str], str]  # (file, (query dtype, cache dtype), arch)
JOBS: list[Job] = [(f, dts, arch) for f in K.SOURCE_FILES for dts in DTYPE_PAIRS for arch in ARCHS]
JOB_IDS = [f"{f}-q_{q}-kv_{kv}-{arch}" for f, (q, kv), arch in JOBS]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[Job, subprocess.CompletedProcess[str]]:
    """All (file, dtypes, arch) compiles, run concurrently (nvcc is single-threaded)."""
    workdir = tmp_path_factory.mktemp("nvcc")

    def run(job: Job) -> subprocess.CompletedProcess[str]:
        f, dts, arch = job
        return nvcc(workdir, f"{f}.{dts[0]}.{dts[1]}.{arch}", f, expressions(f, dts, MODEL_CONFIGS), arch)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(JOBS, pool.map(run, JOBS)))


@needs_nvcc
@pytest.mark.parametrize("job", JOBS, ids=JOB_IDS)
def test_compiles_for_each_dtype_and_arch(compiled: dict[Job, subprocess.CompletedProcess[str]], job: Job) -> None:
    r = compiled[job]
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr.lower(), r.stderr


@needs_nvcc
def test_every_supported_head_dim_and_block_size_compiles(tmp_path: Path) -> None:
    # The layouts the backend accepts beyond the model defaults: every head_dim at its widest CTA, and
    # block sizes from 1 to 256 (tiles then span several blocks, or a block holds many tiles).
    configs = tuple((d, 16, K.max_heads_per_cta(d)) for d in K.SUPPORTED_HEAD_DIMS)
    configs += tuple((64, bs, 2) for bs in (1, 4, 32, 256))
    for f in ("paged_decode.cu", "paged_prefill.cu"):
        r = nvcc(tmp_path, f"layouts-{f}", f, expressions(f, ("bfloat16", "bfloat16"), configs), "sm_90")
        assert r.returncode == 0 and "warning" not in r.stderr.lower(), r.stderr


# ------------------------------------------------------------ sources vs Python: no GPU, no nvcc needed

# __global__ name and parameter text; the closing paren may carry the last argument's comment.
SIGNATURE_RE = re.compile(
    r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\((.*?)\)[ \t]*(//[^\n]*)?\s*\{", re.S)


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def kernel_signatures() -> dict[str, tuple[str, ...]]:
    """__global__ name -> C kinds of its parameters, parsed from the sources."""
    sigs: dict[str, tuple[str, ...]] = {}
    for f in K.SOURCE_FILES:
        for name, params, _ in SIGNATURE_RE.findall(_strip_comments((K.CSRC_DIR / f).read_text())):
            kinds = []
            for p in (p.strip() for p in params.split(",")):
                if "*" in p:
                    kinds.append("ptr")
                else:
                    kinds.append({"int": "i32", "i64": "i64", "float": "f32"}[p.split()[0]])
            sigs[name] = tuple(kinds)
    return sigs


def test_python_argument_types_match_kernel_signatures() -> None:
    assert kernel_signatures() == K.SIGNATURES


def test_python_geometry_matches_common_cuh() -> None:
    text = (K.CSRC_DIR / "common.cuh").read_text()
    defines = dict(re.findall(r"#define (KVG_\w+) (\d+)", text))
    assert int(defines["KVG_WARP"]) == K.WARP
    assert int(defines["KVG_NUM_WARPS"]) == K.NUM_WARPS
    assert int(defines["KVG_TG"]) == K.THREAD_GROUP
    assert int(defines["KVG_MAX_QH"]) == K.MAX_HEADS_PER_CTA
    assert f"__launch_bounds__({K.RESHAPE_MAX_THREADS})" in (K.CSRC_DIR / "reshape_and_cache.cu").read_text()


def test_sources_are_nvrtc_safe_and_documented() -> None:
    # NVRTC has no host headers: only our own includes. Every kernel argument carries a comment, a shape for
    # pointers, and each file explains its thread/block mapping.
    for f in K.SOURCE_FILES:
        text = (K.CSRC_DIR / f).read_text()
        assert not re.search(r"#include\s*<", text), f
        assert "mapping" in text.lower(), f"{f} lacks the thread/block mapping comment"
        for m in SIGNATURE_RE.finditer(text):
            for line in filter(str.strip, (m.group(2) + (m.group(3) or "")).splitlines()):
                assert "//" in line, f"{f}: argument without a comment: {line}"
                if "*" in line.split("//")[0]:
                    assert re.search(r"//\s*\(", line), f"{f}: pointer argument without a shape comment: {line}"
    loaded = K.load_source("paged_decode.cu")
    assert not re.search(r"^\s*#include", loaded, re.M) and loaded.count("struct WarpState") == 1


# ------------------------------------------------------------------------- NVRTC, where libnvrtc exists

def find_nvrtc() -> str | None:
    """libnvrtc from KVGATE_NVRTC, an nvidia-cuda-nvrtc wheel (cu12 or cu13 layout), or the system."""
    import ctypes.util
    import importlib.util

    if os.environ.get("KVGATE_NVRTC"):
        return os.environ["KVGATE_NVRTC"]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        libs = sorted(Path(root).glob("*/lib/libnvrtc.so*"))
        if libs:
            return str(libs[0])
    return ctypes.util.find_library("nvrtc")


def nvrtc_compile(lib_path: str, source: str, exprs: tuple[str, ...], arch: str) -> tuple[int, str, list[str]]:
    """(result code, log, lowered names): the calls CuPy's RawModule makes, through ctypes."""
    import ctypes

    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kvgate.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    for e in exprs:
        lib.nvrtcAddNameExpression(prog, e.encode())
    opts = [b"-std=c++17", f"--gpu-architecture={arch}".encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lowered = []
    if rc == 0:
        for e in exprs:
            name = ctypes.c_char_p()
            lib.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(name))
            lowered.append((name.value or b"").decode())
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), lowered


@pytest.mark.skipif(find_nvrtc() is None, reason="libnvrtc not found (set KVGATE_NVRTC to its path)")
@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compiles_what_the_backend_sends(arch: str) -> None:
    lib = find_nvrtc()
    assert lib is not None
    for f in K.SOURCE_FILES:
        for qdt, kvdt in DTYPE_PAIRS:
            exprs = K.KernelConfig(kvdt, 128, 16, 4, qdt).file_expressions(f)
            rc, log, lowered = nvrtc_compile(lib, K.load_source(f), exprs, arch)
            assert rc == 0 and "warning" not in log.lower(), f"{f} {qdt}/{kvdt}: {log}"
            assert all(name.startswith("_Z") for name in lowered), lowered


# ----------------------------- the kernels outside attention: csrc/lora.cu (kernels_cupy/lora_cuda.py) and
# csrc/rows.cu (kernels_cupy/rows_cuda.py), each compiled with the instantiations its host side asks for

ROW_KERNELS = ("lora_cuda", "rows_cuda")


def _unit(module: str) -> tuple[str, tuple[str, ...]]:
    import importlib

    m = importlib.import_module(f"kernels_cupy.{module}")
    return m.FILE, m.EXPRESSIONS


@needs_nvcc
@pytest.mark.parametrize("module", ROW_KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_row_kernels_compile_for_every_dtype(tmp_path: Path, arch: str, module: str) -> None:
    f, exprs = _unit(module)
    r = nvcc(tmp_path, f"{module}-{arch}", f, exprs, arch)
    assert r.returncode == 0 and "warning" not in r.stderr.lower(), r.stderr


def test_lora_source_matches_its_host_side() -> None:
    from kernels_cupy import lora_cuda as L

    text = (K.CSRC_DIR / L.FILE).read_text()
    sigs = {}
    for name, params, _ in SIGNATURE_RE.findall(_strip_comments(text)):
        sigs[name] = tuple("ptr" if "*" in p else {"int": "i32", "i64": "i64", "float": "f32"}[p.split()[0]]
                           for p in (p.strip() for p in params.split(",")))
    assert sigs == L.SIGNATURES
    defines = dict(re.findall(r"#define (LORA_\w+) (.+?)\s*(?://.*)?$", text, re.M))
    assert int(defines["LORA_MAX_SLICES"]) == L.MAX_SLICES
    assert defines["LORA_REC"] == "(4 + 5 * LORA_MAX_SLICES)" and L.REC == 4 + 5 * L.MAX_SLICES
    assert not re.search(r"#include\s*<", text) and "mapping" in text.lower()
    for m in SIGNATURE_RE.finditer(text):
        for line in filter(str.strip, (m.group(2) + (m.group(3) or "")).splitlines()):
            assert "//" in line, f"argument without a comment: {line}"
            if "*" in line.split("//")[0]:
                assert re.search(r"//\s*\(", line), f"pointer argument without a shape comment: {line}"


@pytest.mark.skipif(find_nvrtc() is None, reason="libnvrtc not found (set KVGATE_NVRTC to its path)")
@pytest.mark.parametrize("module", ROW_KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compiles_the_row_kernels(arch: str, module: str) -> None:
    lib = find_nvrtc()
    assert lib is not None
    f, exprs = _unit(module)
    rc, log, lowered = nvrtc_compile(lib, K.load_source(f), exprs, arch)
    assert rc == 0 and "warning" not in log.lower(), log
    assert all(name.startswith("_Z") for name in lowered), lowered
