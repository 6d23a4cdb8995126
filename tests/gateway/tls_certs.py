"""Certificates made for a test with the ``openssl`` binary: a CA, a server certificate for
127.0.0.1 and localhost, a client certificate, a client certificate of another CA, and a
certificate for another name."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclasses.dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # signed by another CA
    stranger_key: Path
    elsewhere_cert: Path  # signed by the CA for another name, server use only
    elsewhere_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(folder: Path, name: str) -> None:
    _openssl(
        "req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder,
    )  # fmt: skip


def _leaf(folder: Path, ca: str, name: str, extensions: str) -> None:
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(
        "req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=folder,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=folder,
    )  # fmt: skip


def make_certs(folder: Path) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make test certificates with")
    folder.mkdir(parents=True, exist_ok=True)
    _ca(folder, "ca")
    _ca(folder, "other-ca")
    server = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    client = "extendedKeyUsage=clientAuth\n"
    _leaf(folder, "ca", "server", server)
    _leaf(folder, "ca", "client", client)
    _leaf(folder, "other-ca", "stranger", client)
    elsewhere = "subjectAltName=DNS:elsewhere.invalid\nextendedKeyUsage=serverAuth\n"
    _leaf(folder, "ca", "elsewhere", elsewhere)
    return Certs(
        ca=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
        stranger_cert=folder / "stranger.pem",
        stranger_key=folder / "stranger.key",
        elsewhere_cert=folder / "elsewhere.pem",
        elsewhere_key=folder / "elsewhere.key",
    )
