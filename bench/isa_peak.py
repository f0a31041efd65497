"""How close the A16 GEMM runs to the multiply-add instruction it is built on, and what 8-bit activations would
allow, on this CPU (one core).

Why: `auto`'s linears multiply 12-bit activation codes held in 16 bits (issue 29, goal 2: int8 activations miss
the quality gate on this model), so their arithmetic is 16-bit pairs (`vpdpwssd` on AVX-512 VNNI, `vpmaddwd` on
AVX2), where a peer with int8 activations (OpenVINO's default, llama.cpp's Q8 activations) runs 8-bit quads
(`vpdpbusd`): twice the multiply-adds an instruction. This prints both peaks and the kernel's rate as a share of
its own, so a session on a new CPU sees at once whether the kernel or the instruction is the limit.

    .venv/bin/python bench/isa_peak.py [--bits 4] [--rounds 3] [--isa vnni256]

Compiles ``bench/isa_peak.c`` (tight loops of 12 independent accumulators per instruction the CPU has) and
``bench/qgemm16_harness.cpp`` with the GEMM module's flags (one thread, in cache, every result checked bit for bit
against the scalar reference; the packed codes' rate where the path has one), runs them ``--rounds`` times
alternately and prints the best of each. ``--isa`` sets ``KVGATE_QGEMM_ISA`` for the harness.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from build_tuning import BUILDS, harness_args, run  # noqa: E402
from peer_servers import cpu_line  # noqa: E402

# The A16 kernel's multiply per path (KVGATE_QGEMM_ISA / the module's isa()), and the 8-bit one beside it.
# On AMX a 12-bit code takes two bytes of a tile product's depth (its hi and lo bytes: qgemm_a16_amx.h), so the
# kernel's peak is tdpbusd's at half the multiply-adds a step (AMX16, derived from the tdpbusd line).
AMX16 = "tdpbusd-amx, two bytes a 12-bit code"
SIXTEEN = {"avx2": "vpmaddwd+vpaddd-ymm", "avx512-vnni-ymm": "vpdpwssd-ymm", "avx512-vnni": "vpdpwssd-zmm",
           "avx512-vnni+amx": AMX16}
EIGHT = {"avx2": "vpmaddubsw+vpmaddwd+vpaddd-ymm", "avx512-vnni-ymm": "vpdpbusd-ymm", "avx512-vnni": "vpdpbusd-zmm",
         "avx512-vnni+amx": "tdpbusd-amx"}


def peaks(binary: Path) -> dict[str, tuple[int, float]]:
    """instruction (or AVX2 sequence) -> (multiply-adds a step, G steps/s) of one run of isa_peak.c."""
    out = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    rates = {}
    for ln in out.splitlines():
        name, macs, rate = ln.split()
        rates[name] = (int(macs), float(rate))
    return rates


def kernel_isa(env: dict[str, str]) -> str:
    """The A16 kernel's path in a process with the harness's environment (KVGATE_QGEMM_ISA or the module's pick)."""
    code = "from kernels_cupy.cpu.qgemm import load_qgemm; print(load_qgemm().isa())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    args, env = harness_args(__doc__ or "")
    path = kernel_isa(env)
    with tempfile.TemporaryDirectory() as tmp:
        peak_bin, gemm_bin = Path(tmp) / "peak", Path(tmp) / "gemm"
        cc = shutil.which("gcc") or "cc"  # a device image may have only its own toolchain's name on PATH
        subprocess.run([cc, "-O2", str(REPO / "bench/isa_peak.c"), "-o", str(peak_bin)], check=True)
        subprocess.run(["g++", *BUILDS["module"], "-std=c++17", f"-I{REPO / 'kernels_cupy/cpu'}",
                        str(REPO / "bench/qgemm16_harness.cpp"), "-o", str(gemm_bin)], check=True)
        inst: dict[str, tuple[int, float]] = {}
        gemm: dict[tuple[int, int, int], float] = {}
        for _ in range(args.rounds):
            for name, (macs, rate) in peaks(peak_bin).items():
                inst[name] = (macs, max(inst.get(name, (macs, 0.0))[1], rate))
            for key, rate in run(gemm_bin, args.bits, env).items():
                gemm[key] = max(gemm.get(key, 0.0), rate)
    if "tdpbusd-amx" in inst:
        inst[AMX16] = (inst["tdpbusd-amx"][0] // 2, inst["tdpbusd-amx"][1])
    print(f"CPU: {cpu_line()}; the A16 kernel's path: {path}; best of {args.rounds} alternating rounds, one thread\n")
    print("| instruction (AVX2: the sequence of one step) | multiply-adds a step | G steps/s | GMAC/s |")
    print("|---|---:|---:|---:|")
    for name, (macs, rate) in inst.items():
        print(f"| `{name}` | {macs} | {rate:.2f} | {macs * rate:.1f} |")
    sixteen, eight = SIXTEEN.get(path), EIGHT.get(path)
    if sixteen not in inst or eight not in inst:
        print(f"\nNo 16-bit multiply-add measured for the path {path!r}: nothing to compare the kernel with.")
        return
    peak16 = inst[sixteen][0] * inst[sixteen][1]
    peak8 = inst[eight][0] * inst[eight][1]
    print(f"\nThe A16 kernel ({args.bits}-bit weights) against `{sixteen}`, {peak16:.1f} GMAC/s; "
          f"`{eight}` (8-bit activations) would allow {peak8:.1f}:\n")
    print(f"| (N, K) | M | GMAC/s | share of `{sixteen}` | share of `{eight}` |")
    print("|---|---:|---:|---:|---:|")
    for (n, k, m), rate in sorted(gemm.items()):
        print(f"| ({n}, {k}) | {m} | {rate:.1f} | {rate / peak16:.0%} | {rate / peak8:.0%} |")


if __name__ == "__main__":
    main()
