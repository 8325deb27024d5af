"""Credentials of one test bed, written into its state dir (`pki/`, kubeconfigs); starts nothing.

A CA, the API server's serving certificate, the service-account key pair (openssl), a client
certificate the API server shows kubelets, the aggregation layer's front-proxy CA and client
certificate (what the API server shows an extension API server it proxies to, such as KEDA's
metrics API server), static bearer tokens (`tokens.csv`) and one
kubeconfig per user. `down` leaves them, so exported kubeconfigs stay valid across restarts.
"""

from __future__ import annotations

import base64
import secrets
import shutil
import subprocess
from pathlib import Path

import yaml

DNS_SANS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _signed_cert(pki: Path, name: str, subject: str, ext: str, ca: str = "ca") -> None:
    """`name`.crt and .key, signed by the CA `ca`.crt/.key of `pki`."""
    (pki / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
             "-keyout", str(pki / f"{name}.key"), "-out", str(pki / f"{name}.csr"))  # fmt: skip
    _openssl("x509", "-req", "-in", str(pki / f"{name}.csr"), "-CA", str(pki / f"{ca}.crt"),
             "-CAkey", str(pki / f"{ca}.key"), "-CAcreateserial", "-days", "3650",
             "-extfile", str(pki / f"{name}.ext"), "-out", str(pki / f"{name}.crt"))  # fmt: skip


def make_pki(pki: Path, ip_sans: tuple[str, ...]) -> None:
    """CA, apiserver serving cert for `ip_sans` and the kubernetes.default names, SA key pair,
    and `kubelet-client` (what the API server shows kubelets). Kept when already there."""
    pki.mkdir(parents=True, exist_ok=True)
    wanted = ",".join([*(f"IP:{ip}" for ip in ip_sans), *(f"DNS:{d}" for d in DNS_SANS)])
    ext_file = pki / "apiserver.ext"
    if (pki / "kubelet-client.crt").exists() and wanted in (
        ext_file.read_text() if ext_file.exists() else ""
    ):
        return
    if not shutil.which("openssl"):
        raise RuntimeError("openssl is required to create the test bed certificates")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
             "-subj", "/CN=vllmdp-testbed-ca",
             "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"))  # fmt: skip
    _signed_cert(pki, "apiserver", "/CN=kube-apiserver",
                 "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                 f"extendedKeyUsage=serverAuth\nsubjectAltName={wanted}\n")  # fmt: skip
    _signed_cert(pki, "kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
                 "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                 "extendedKeyUsage=clientAuth\n")  # fmt: skip
    _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def write_tokens(
    pki: Path, users: dict[str, tuple[str, str]], tokens: dict[str, str]
) -> tuple[Path, dict[str, str]]:
    """`tokens.csv` for `users` (component -> (user, group)); reuses tokens already issued."""
    tokens = dict(tokens)
    for comp in users:
        tokens.setdefault(comp, secrets.token_hex(24))
    path = pki / "tokens.csv"
    path.write_text("".join(f'{tokens[c]},{u},{u},"{g}"\n' for c, (u, g) in users.items()))
    path.chmod(0o600)
    return path, tokens


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, user: str) -> None:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "testbed",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": "testbed",
                "context": {"cluster": "testbed", "user": user, "namespace": "default"},
            }
        ],
        "current-context": "testbed",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)


def serving_cert(pki: Path, name: str, ip: str) -> tuple[Path, Path]:
    """A serving certificate for `ip`, signed by the bed's CA (made once); (cert, key)."""
    if not (pki / f"{name}.crt").exists():
        _signed_cert(pki, name, f"/CN={name}",
                     "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                     f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:{ip}\n")  # fmt: skip
    return pki / f"{name}.crt", pki / f"{name}.key"


def front_proxy(pki: Path) -> dict[str, Path]:
    """The aggregation layer's own CA and the client certificate the API server proxies with
    (CN front-proxy-client, as kubeadm names it); made once. Apart from the bed's CA, so no
    other certificate of the bed can assert a user to an extension API server."""
    files = {n: pki / f"front-proxy-{n}" for n in ("ca.crt", "client.crt", "client.key")}
    if all(f.exists() for f in files.values()):
        return files
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
             "-subj", "/CN=vllmdp-testbed-front-proxy-ca", "-keyout",
             str(pki / "front-proxy-ca.key"), "-out", str(files["ca.crt"]))  # fmt: skip
    _signed_cert(pki, "front-proxy-client", "/CN=front-proxy-client",
                 "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                 "extendedKeyUsage=clientAuth\n", ca="front-proxy-ca")  # fmt: skip
    return files

