"""The ISA levels the native kernels are built for, lowest first: what each needs of the CPU and
what its build enables. Plain data with no imports: `setup.py` reads it before pdserve is
installed, and the package picks a level from it at run time (`native/__init__.py`).

Each level is the one source file, `model.cpp`, compiled with that level's instructions enabled
(as `units/<level>.cpp`, which includes it: a translation unit, and object file, per level);
`avx2` takes its kernels from `avx2/`, the others from `avx512/` (which compiles its AVX512-BF16
and AMX paths where the flags enable them).
"""

# level: (flags /proc/cpuinfo shows for what this level adds to the one below, compiler flags of the build)
LEVELS = {
    "avx2": (("avx", "avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx512dq"),
               ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")),
    "avx512_bf16": (("avx512_bf16", "avx512_vnni"),
                    ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                     "-mavx512bf16", "-mavx512vnni")),
    # AMX also needs the OS to lend the process its tile state (checked at run time)
    "amx": (("amx_tile", "amx_bf16"),
            ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
             "-mavx512vnni", "-mamx-tile", "-mamx-bf16")),
}
COMMON_FLAGS = ("-O3", "-g0", "-fopenmp", "-fvisibility=hidden")  # -g0: no debug info (0.5-1 MB a level, not 15-20)
MODULE_PREFIX = "_kernels_"  # the extension of level L is pdserve.engine.model.native._kernels_L
