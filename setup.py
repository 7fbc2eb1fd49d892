"""The C helper under native/ is built as dlfs._native, and `dlfs run`'s preload library as dlfs._preload (a plain
shared object for LD_PRELOAD, never imported); everything else is in pyproject.toml."""

import subprocess

from setuptools import Extension, setup


def fuse3_cflags() -> list[str]:
    try:
        out = subprocess.run(["pkg-config", "--cflags", "fuse3"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ["-I/usr/include/fuse3"]
    return out.stdout.split()


setup(
    ext_modules=[
        Extension(
            "dlfs._native",
            sources=["native/module.c", "native/fusehook.c", "native/engine.c", "native/uring.c", "native/answer.c",
                     "native/shm.c", "native/indexview.c", "native/indexobj.c", "native/cacheregion.c",
                     "native/cacheowner.c", "native/direct.c", "native/hugearena.c", "native/hugebuf.c", "native/ahead.c", "native/chunkfiles.c", "native/diskcache.c", "native/remote.c", "native/rangeserve.c"],
            depends=["native/fusehook.h", "native/engine.h", "native/answer.h", "native/shm.h", "native/indexview.h",
                     "native/module.h", "native/cacheregion.h", "native/chunkfiles.h", "native/hash.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror=implicit-function-declaration", *fuse3_cflags()],
            libraries=["dl", "fuse3", "pthread", "xxhash"],
        ),
        Extension(
            "dlfs._preload",
            sources=["native/preload.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-fvisibility=hidden", "-Werror=implicit-function-declaration"],
            libraries=["dl"],
        ),
    ]
)
