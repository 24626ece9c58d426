"""native.h is the one declaration of what C and Python share: the ctypes structs read from it lay out as the C
compiler lays out the same structs."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from deltaserve.kernels import native


def test_the_structs_read_from_the_header_have_the_c_compilers_layout(tmp_path):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    checks = []
    for name, struct in native.STRUCTS.items():
        checks.append(("sizeof", name, "", ctypes.sizeof(struct)))
        for member, _ in struct._fields_:
            checks.append(("offsetof", name, member, getattr(struct, member).offset))
    lines = [f'printf("%zu\\n", {"sizeof(" + n + ")" if k == "sizeof" else f"offsetof({n}, {m})"});'
             for k, n, m, _ in checks]
    src = tmp_path / "layout.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "native.h"\nint main(void) {\n'
                   + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{native.HEADER.parent}", str(src), "-o", str(exe)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    want = [v for *_, v in checks]
    assert got == want, [(c[:3], g) for c, g in zip(checks, got) if c[3] != g]
    assert len(checks) > 40  # every struct and member was compared


def test_the_constants_come_from_the_header():
    assert native.ABI == native.CONSTANTS["DS_ABI"]
    assert native.MAX_ROWS == native.CONSTANTS["DS_MAX_ROWS"] == 8
