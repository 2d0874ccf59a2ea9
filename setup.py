"""Build of cyllm: the Python package (src/cyllm), the CUDA sources shipped as
cyllm._cuda (cuda/), and one Cython extension cyllm._ext.kernels (cython_ext/).

Compiler flags, and why:
- -O3 everywhere, never -march=native: the wheel must run on any x86-64 (or ARM).
- OpenMP (-fopenmp) when a tiny test program compiles and links with it; otherwise
  a warning and a serial build (prange degrades to a plain loop, omp_shim.h stubs
  the runtime calls).
- -mavx2 -mfma -mf16c ONLY on cython_ext/csrc/kernels_avx2.c, compiled to its own
  object and linked in; the rest stays at the baseline ISA so the extension imports
  on CPUs without AVX2, where dispatch.c (cpuid + xgetbv) never selects that code.
  Non-x86 targets (ARM) build only the generic C. CYLLM_NO_AVX2=1 skips it too.
- -mavx512f (+ the AVX2 flags) ONLY on cython_ext/csrc/kernels_avx512.c (the prefill
  GEMM of the "avx512" variant), selected at run time like the AVX2 code.
  CYLLM_NO_AVX512=1 skips it.
- CYLLM_NO_OPENMP=1 forces the serial build (to test that path).
- The quantized kernels (csrc/quant_*.c, see csrc/quant.h) are separate objects, all
  with -ffp-contract=off (no silent a*b+c -> fma: the dequantizers must give the NumPy
  reference's bits on every target, aarch64 included; the kernels write their FMAs
  explicitly): quant_generic.c at the baseline ISA; quant_avx2.c with the AVX2 flags;
  quant_avxvnni.c with -mavxvnni and quant_avx512.c with -mavx512f/bw/vl/vnni, each
  only when the compiler accepts the flags (probed), selected at run time by cpuid
  (quant_dispatch.c). CYLLM_NO_AVX512=1 skips the avx512vnni object too. The weight
  quantizers (csrc/quant_quantize.c) are baseline-ISA scalar C with the same flag: their
  bytes must be the NumPy reference's (llama.cpp's reference quantizers).
"""

import glob
import os
import platform
import shutil
import sys
import tempfile

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

CSRC = os.path.join("cython_ext", "csrc")
AVX2_SOURCE = os.path.join(CSRC, "kernels_avx2.c")
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
AVX512_SOURCE = os.path.join(CSRC, "kernels_avx512.c")
AVX512_FLAGS = AVX2_FLAGS + ["-mavx512f"]
HEADERS = [os.path.join(CSRC, h) for h in ("kernels.h", "act.h", "fp16.h", "omp_shim.h", "gemm_pack.h",
                                           "thread_probe.h")]
QUANT_HEADERS = [os.path.join(CSRC, h) for h in ("quant.h", "act.h", "quant_impl.h", "quant_x86.h", "fp16.h")]
QUANT_GENERIC_SOURCE = os.path.join(CSRC, "quant_generic.c")
QUANT_QUANTIZE_SOURCE = os.path.join(CSRC, "quant_quantize.c")
QUANT_AVX2_SOURCE = os.path.join(CSRC, "quant_avx2.c")
QUANT_AVXVNNI_SOURCE = os.path.join(CSRC, "quant_avxvnni.c")
QUANT_AVX512_SOURCE = os.path.join(CSRC, "quant_avx512.c")
AVXVNNI_FLAGS = AVX2_FLAGS + ["-mavxvnni"]
AVX512VNNI_FLAGS = AVX2_FLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]

OPENMP_PROBE = r"""
#include <omp.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    return n > 0 && omp_get_max_threads() > 0 ? 0 : 1;
}
"""

AVX2_PROBE = r"""
#include <immintrin.h>
int main(void) {
    unsigned short h[8] = {0};
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
    a = _mm256_fmadd_ps(a, a, a);
    __m256i b = _mm256_add_epi32(_mm256_castps_si256(a), _mm256_set1_epi32(1));
    return _mm256_extract_epi32(b, 0) == 12345;
}
"""


AVX512_PROBE = r"""
#include <immintrin.h>
int main(void) {
    float f[16] = {0};
    __m512 a = _mm512_fmadd_ps(_mm512_loadu_ps(f), _mm512_set1_ps(2.0f), _mm512_set1_ps(1.0f));
    _mm512_storeu_ps(f, a);
    return f[3] == 12345.0f;
}
"""


AVXVNNI_PROBE = r"""
#include <immintrin.h>
int main(void) {
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
    __m256i c = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
    return _mm256_extract_epi32(c, 0) == 12345;
}
"""

AVX512VNNI_PROBE = r"""
#include <immintrin.h>
int main(void) {
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
    __m256i c = _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
    __m512i z = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_set1_epi8(1));
    return _mm256_extract_epi32(c, 0) + _mm512_reduce_add_epi32(z) == 12345;
}
"""


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


class BuildExt(build_ext):
    """build_ext that probes OpenMP and the AVX2 flags, then compiles the AVX2 object."""

    def _probe(self, source: str, cflags: list, ldflags: list) -> bool:
        tmp = tempfile.mkdtemp(prefix="cyllm-probe-")
        try:
            path = os.path.join(tmp, "probe.c")
            with open(path, "w") as f:
                f.write(source)
            # keep the probe quiet: a failing compiler prints errors we expect
            saved = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            try:
                objs = self.compiler.compile([path], output_dir=tmp, extra_postargs=cflags)
                self.compiler.link_executable(objs, "probe", output_dir=tmp, extra_postargs=ldflags)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                os.close(devnull)
            return True
        except Exception:
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def build_extensions(self):
        msvc = self.compiler.compiler_type == "msvc"
        opt = ["/O2"] if msvc else ["-O3"]
        omp_cflags = ["/openmp"] if msvc else ["-fopenmp"]
        omp_ldflags = [] if msvc else ["-fopenmp"]

        openmp = (os.environ.get("CYLLM_NO_OPENMP", "") != "1"
                  and self._probe(OPENMP_PROBE, omp_cflags, omp_ldflags))
        if not openmp:
            self.warn(
                "\n" + "=" * 78 + "\n"
                "cyllm: the C compiler does not support OpenMP (-fopenmp failed).\n"
                "Building SINGLE-THREADED kernels: everything works, but decode will\n"
                "use one core. Install an OpenMP-capable compiler (gcc, or clang with\n"
                "libomp) and rebuild to use all cores.\n" + "=" * 78)

        # cpuid detection in dispatch.c uses GCC/Clang builtins: no AVX2 variant on MSVC.
        avx2 = (not msvc and is_x86() and os.environ.get("CYLLM_NO_AVX2", "") != "1"
                and self._probe(AVX2_PROBE, AVX2_FLAGS, []))
        if not avx2 and is_x86() and not msvc and os.environ.get("CYLLM_NO_AVX2", "") != "1":
            self.warn("cyllm: the compiler rejects -mavx2 -mfma -mf16c; building the generic kernels only")

        for ext in self.extensions:
            ext.extra_compile_args = list(ext.extra_compile_args or []) + opt
            if openmp:
                ext.extra_compile_args += omp_cflags
                ext.extra_link_args = list(ext.extra_link_args or []) + omp_ldflags
            if avx2:
                objs = self.compiler.compile(
                    [AVX2_SOURCE], output_dir=self.build_temp,
                    include_dirs=[CSRC], macros=[("CYLLM_HAVE_AVX2", "1")],
                    extra_postargs=opt + AVX2_FLAGS, depends=HEADERS)
                ext.extra_objects = list(ext.extra_objects or []) + objs
                ext.define_macros = list(ext.define_macros or []) + [("CYLLM_HAVE_AVX2", "1")]
        # the avx512 variant = the avx2 kernels + an AVX-512F GEMM (prefill); CYLLM_NO_AVX512=1 skips it
        avx512 = (avx2 and os.environ.get("CYLLM_NO_AVX512", "") != "1"
                  and self._probe(AVX512_PROBE, AVX512_FLAGS, []))
        if avx512:
            for ext in self.extensions:
                objs = self.compiler.compile(
                    [AVX512_SOURCE], output_dir=self.build_temp,
                    include_dirs=[CSRC], macros=[("CYLLM_HAVE_AVX2", "1"), ("CYLLM_HAVE_AVX512", "1")],
                    extra_postargs=opt + AVX512_FLAGS, depends=HEADERS)
                ext.extra_objects = list(ext.extra_objects or []) + objs
                ext.define_macros = list(ext.define_macros or []) + [("CYLLM_HAVE_AVX512", "1")]
        # quantized kernels: generic always; x86 variants when the compiler takes their flags
        nocontract = [] if msvc else ["-ffp-contract=off"]
        quant = [(QUANT_GENERIC_SOURCE, [], []), (QUANT_QUANTIZE_SOURCE, [], [])]
        avxvnni = avx512vnni = False
        if avx2:
            quant.append((QUANT_AVX2_SOURCE, AVX2_FLAGS, [("CYLLM_HAVE_AVX2", "1")]))
            avxvnni = self._probe(AVXVNNI_PROBE, AVXVNNI_FLAGS, [])
            if avxvnni:
                quant.append((QUANT_AVXVNNI_SOURCE, AVXVNNI_FLAGS, [("CYLLM_HAVE_AVXVNNI", "1")]))
            avx512vnni = (os.environ.get("CYLLM_NO_AVX512", "") != "1"
                          and self._probe(AVX512VNNI_PROBE, AVX512VNNI_FLAGS, []))
            if avx512vnni:
                quant.append((QUANT_AVX512_SOURCE, AVX512VNNI_FLAGS, [("CYLLM_HAVE_AVX512VNNI", "1")]))
        for ext in self.extensions:
            for src, flags, macros in quant:
                objs = self.compiler.compile(
                    [src], output_dir=self.build_temp, include_dirs=[CSRC], macros=macros,
                    extra_postargs=opt + flags + nocontract, depends=QUANT_HEADERS)
                ext.extra_objects = list(ext.extra_objects or []) + objs
                ext.define_macros = list(ext.define_macros or []) + macros
        print(f"cyllm: quantized kernels: generic{', avx2' if avx2 else ''}"
              f"{', avxvnni' if avxvnni else ''}{', avx512vnni' if avx512vnni else ''}", file=sys.stderr)
        print(f"cyllm: building kernels with OpenMP={'yes' if openmp else 'NO'}, "
              f"AVX2 variant={'yes' if avx2 else 'no'}, AVX-512 variant={'yes' if avx512 else 'no'}",
              file=sys.stderr)
        super().build_extensions()


def extensions():
    import numpy
    from Cython.Build import cythonize

    ext = Extension(
        "cyllm._ext.kernels",
        sources=[os.path.join("cython_ext", "kernels.pyx"),
                 os.path.join(CSRC, "kernels_generic.c"),
                 os.path.join(CSRC, "dispatch.c"),
                 os.path.join(CSRC, "program.c"),
                 os.path.join(CSRC, "thread_probe.c"),
                 os.path.join(CSRC, "quant_dispatch.c")],
        include_dirs=[numpy.get_include(), CSRC],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        # the AVX2 object is linked in by BuildExt: list it so edits relink
        depends=HEADERS + QUANT_HEADERS + [AVX2_SOURCE, AVX512_SOURCE, QUANT_GENERIC_SOURCE,
                                           QUANT_QUANTIZE_SOURCE,
                                           QUANT_AVX2_SOURCE, QUANT_AVXVNNI_SOURCE,
                                           QUANT_AVX512_SOURCE]
                + sorted(glob.glob(os.path.join("cython_ext", "*.pxi"))),    # included by kernels.pyx
    )
    return cythonize([ext], language_level=3, quiet=True)


setup(
    package_dir={"": "src", "cyllm._cuda": "cuda", "cyllm._ext": "cython_ext"},
    packages=find_packages(where="src") + ["cyllm._cuda", "cyllm._ext"],
    package_data={"cyllm._cuda": ["*.cu", "*.cuh"]},
    # the kernel sources are compiled in; the wheel needs only the extension
    exclude_package_data={"cyllm._ext": ["*.c", "*.pyx", "csrc/*"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
