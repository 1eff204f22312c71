"""The compiled-library cache: private, checked before loading, atomic, keyed, self-repairing, bounded."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

from slipcache import _native
from slipcache._native import build

pytestmark = pytest.mark.skipif(build._compiler() is None, reason="no C compiler")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def built_library(directory: Path) -> Path:
    (library,) = directory.glob("slipcache_native_*.so")
    return library


def test_fresh_cache_is_private_and_loads(tmp_path: Path) -> None:
    directory = tmp_path / "cache" / "native"
    library = _native.load_library(directory)
    assert library.sgd_update is not None
    assert mode(directory) == 0o700
    assert mode(built_library(directory)) & 0o077 == 0
    assert [p.name for p in directory.iterdir()] == [built_library(directory).name]  # no temporary left


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "native"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(_native.UnsafeCacheError, match="writable by its group or by everyone"):
        _native.load_library(directory)
    assert not list(directory.iterdir())  # nothing built, nothing loaded
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)  # without the sticky bit anyone could swap the directory itself
    with pytest.raises(_native.UnsafeCacheError, match="writable by everyone"):
        _native.load_library(world / "native")


def test_a_link_instead_of_the_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "native").symlink_to(elsewhere)
    with pytest.raises(_native.UnsafeCacheError, match="not a directory"):
        _native.load_library(tmp_path / "native")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "native"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(_native.UnsafeCacheError, match="belongs to another user"):
        _native.load_library(directory)


@pytest.mark.slow
def test_a_planted_or_corrupt_library_is_replaced_by_a_fresh_build(tmp_path: Path) -> None:
    """Each case in a fresh directory: a library once loaded stays mapped under its name in this process."""
    _native.load_library(tmp_path / "reference")
    good = built_library(tmp_path / "reference").read_bytes()
    name = built_library(tmp_path / "reference").name
    for case, content, file_mode in (("corrupt", b"not a shared object", 0o600), ("planted", good, 0o666)):
        directory = tmp_path / case
        directory.mkdir(mode=0o700)
        (directory / name).write_bytes(content)
        (directory / name).chmod(file_mode)  # 0o666: anyone could have rewritten it; never loaded as it is
        _native.load_library(directory)
        assert (directory / name).read_bytes() == good and mode(directory / name) & 0o077 == 0, case


def test_cache_key_follows_compiler_flags_and_source(monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = build._compiler()
    key = _native.cache_key(compiler)
    assert _native.cache_key(compiler) == key
    assert _native.cache_key(compiler, ("-O2", "-shared", "-fPIC")) != key
    for name in (build.HEADER, *build.SOURCES):  # every file compiled, the shared header included
        with monkeypatch.context() as changed:
            changed.setitem(build._TEXTS, name, build._TEXTS[name] + "\n/* changed */\n")
            assert _native.cache_key(compiler) != key, name
    assert _native.cache_key(compiler) == key
    monkeypatch.setenv("SLIPCACHE_NATIVE_SANITIZE", "1")  # the sanitized build is a library of its own
    assert "-fsanitize=address,undefined" in build.build_flags() and _native.cache_key(compiler) != key


def test_each_c_file_compiles_on_its_own(tmp_path: Path) -> None:
    """No file relies on another pasted before it: each compiles alone against the shared header, without a
    undeclared name, and every .c file beside the wrappers is one the build compiles."""
    directory = Path(build.__file__).parent
    assert sorted(p.name for p in directory.glob("*.c")) == sorted(build.SOURCES)
    for name in build.SOURCES:
        result = subprocess.run(
            [build._compiler(), "-Werror=implicit-function-declaration", "-Werror=implicit-int", "-pthread", "-fPIC",
             "-c", str(directory / name), "-o", str(tmp_path / f"{name}.o")],
            capture_output=True, text=True,
        )  # fmt: skip
        assert result.returncode == 0, (name, result.stderr)


def test_a_hanging_compiler_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "slowcc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\nsleep 5\n")
    fake.chmod(0o700)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 0.3)
    with pytest.raises(OSError, match="took over 0.3 s"):
        _native.load_library(tmp_path / "native")


def test_a_compiler_without_target_clones_still_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = build._compiler()
    fake = tmp_path / "oldcc"  # rejects the AVX2 clones (no ifunc), as old compilers or musl do
    fake.write_text('#!/bin/sh\n'
                    'case " $* " in *" -DSLIPCACHE_NO_CLONES "*) ;; *) [ "$1" = --version ] || exit 1;; esac\n'
                    f'exec {real} "$@"\n')
    fake.chmod(0o700)
    monkeypatch.setenv("CC", str(fake))
    library = _native.load_library(tmp_path / "native")
    assert library.sgd_update is not None


def test_unavailable_library_warns_once_and_torch_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    (cache / "native").mkdir(parents=True)
    (cache / "native").chmod(0o775)
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(cache))
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_library", None)
    with pytest.warns(UserWarning, match="compiled loops unavailable, using torch: .*writable"):
        assert _native.native() is None
    assert _native.native() is None  # decided once


def test_no_compiler_is_quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_compiler", lambda: None)
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_library", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.native() is None


def test_a_foreign_library_without_our_symbols_is_rebuilt_and_the_rebuild_loads(tmp_path: Path) -> None:
    """The foreign file loads (and stays loaded in this process) but lacks our loops: the rebuild must not
    be answered with the foreign handle."""
    directory = tmp_path / "native"
    directory.mkdir(mode=0o700)
    target = directory / f"slipcache_native_{_native.cache_key(build._compiler())}.so"
    foreign = tmp_path / "foreign.c"
    foreign.write_text("int foreign_symbol(void) { return 1; }\n")
    subprocess.run([build._compiler(), "-shared", "-fPIC", "-o", str(target), str(foreign)], check=True)
    target.chmod(0o700)
    library = _native.load_library(directory)
    assert library.sgd_update is not None
    assert sorted(p.name for p in directory.iterdir()) == [target.name]  # the loading link is gone
