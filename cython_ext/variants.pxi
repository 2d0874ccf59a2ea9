# Kernel variants (generic, avx2, avx512): what this CPU and this build can run, and
# which one an op table uses ($CYLLM_KERNELS or the best). Included by kernels.pyx.

VARIANTS = ("generic", "avx2", "avx512")


# -- CPU / build facts -------------------------------------------------------------

def cpu_features():
    """SIMD features usable on this CPU and OS, e.g. ["avx", "avx2", "fma", "f16c", "avx512f"]."""
    cdef int f = cyllm_cpu_features()
    names = []
    for bit, name in ((CYLLM_CPU_AVX, "avx"), (CYLLM_CPU_AVX2, "avx2"), (CYLLM_CPU_FMA, "fma"),
                      (CYLLM_CPU_F16C, "f16c"), (CYLLM_CPU_AVX512F, "avx512f")):
        if f & bit:
            names.append(name)
    return names


def openmp_enabled():
    """True when the extension was compiled with OpenMP (else every loop is serial)."""
    return bool(CYLLM_OPENMP)


def omp_max_threads():
    return omp_get_max_threads()


def avx2_compiled():
    """True when the AVX2 variant was built into this extension (x86 builds only)."""
    return bool(cyllm_avx2_compiled())


def avx512_compiled():
    """True when the avx512 variant (AVX-512F prefill GEMM) was built into this extension."""
    return bool(cyllm_avx512_compiled())


def available_variants():
    """Variants that can run here, best first."""
    return [v for v in ("avx512", "avx2", "generic") if cyllm_kernels_by_name(v.encode()) != NULL]


def resolve_variant(variant=None):
    """The kernel variant to use: `variant`, else $CYLLM_KERNELS, else the best available.

    Accepts "auto" | "generic" | "avx2" | "avx512"; raises BackendUnavailableError for an
    unknown name or a variant this CPU (or this build) cannot run.
    """
    source = "variant"
    if variant is None:
        variant = os.environ.get("CYLLM_KERNELS", "").strip()
        source = "CYLLM_KERNELS"
        if not variant:
            variant = "auto"
    if not isinstance(variant, str):
        raise BackendUnavailableError(f"{source} must be a string, got {variant!r}")
    v = variant.strip().lower()
    if v == "auto":
        return available_variants()[0]
    if v not in VARIANTS:
        raise BackendUnavailableError(
            f"unknown kernel variant {variant!r} in {source} (choose from auto, {', '.join(VARIANTS)})")
    if cyllm_kernels_by_name(v.encode()) == NULL:
        if v == "avx512" and not cyllm_avx512_compiled():
            raise BackendUnavailableError(
                "kernel variant 'avx512' was not built into this extension (non-x86 target or "
                "the compiler lacks -mavx512f); use CYLLM_KERNELS=avx2 or generic")
        if v == "avx512":
            raise BackendUnavailableError(
                f"kernel variant 'avx512' needs a CPU with AVX-512F, AVX2, FMA and F16C; this CPU "
                f"has [{', '.join(cpu_features())}]; use CYLLM_KERNELS=avx2 or generic")
        if not cyllm_avx2_compiled():
            raise BackendUnavailableError(
                f"kernel variant {v!r} was not built into this extension (non-x86 target "
                "or the compiler lacks -mavx2); use CYLLM_KERNELS=generic")
        raise BackendUnavailableError(
            f"kernel variant {v!r} needs a CPU with AVX2, FMA and F16C; this CPU has "
            f"[{', '.join(cpu_features())}]; use CYLLM_KERNELS=generic")
    return v


# The default is resolved once, at import; a bad $CYLLM_KERNELS is reported when a
# backend is created (an import error would read as "extension not built").
try:
    DEFAULT_VARIANT = resolve_variant(None)
    _DEFAULT_ERROR = None
except BackendUnavailableError as _e:
    DEFAULT_VARIANT = None
    _DEFAULT_ERROR = _e
