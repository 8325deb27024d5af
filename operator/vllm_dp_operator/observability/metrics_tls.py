"""The metrics server's TLS: a server context from a certificate and key file, loaded again
when the files change (cert-manager renews a Secret in place; the kubelet swaps the mounted
files), so a renewed certificate is served with no restart.

A scraper's bearer token (the secure metrics server's credential) then never crosses the
network in clear, and the scraper can check whom it sends it to.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

#: How often the files are looked at for a renewal.
RELOAD_SECONDS = 60.0


class ServingCert:
    """A TLS server context for one certificate/key pair, reloaded on change."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert, self.key = Path(cert_file), Path(key_file)
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._seen: tuple[float, float] | None = None
        self.reload()

    def _stamp(self) -> tuple[float, float]:
        return (self.cert.stat().st_mtime, self.key.stat().st_mtime)

    def reload(self) -> bool:
        """Load the pair into the context if it changed since the last load; whether it did.
        A pair that cannot be loaded (half written, a key of another certificate) keeps the
        one served before: it is tried on a context of its own first, from one read of both
        files, because a failed load leaves a context half changed."""
        try:
            stamp = self._stamp()
            if stamp == self._seen:
                return False
            with tempfile.TemporaryDirectory(prefix="metrics-tls-") as tmp:
                cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
                cert.write_bytes(self.cert.read_bytes())
                key.write_bytes(self.key.read_bytes())
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
                self.context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            if self._seen is None:
                raise  # nothing to serve: the start fails, naming the file
            log.warning("Keeping the metrics certificate served so far: cannot load %s: %r",
                        self.cert, exc)  # fmt: skip
            return False
        if self._seen is not None:
            log.info("Loaded the renewed metrics certificate from %s", self.cert)
        self._seen = stamp
        return True

    async def keep_fresh(self, period: float = RELOAD_SECONDS) -> None:
        """Reload on change, every `period` seconds, until cancelled."""
        while True:
            await asyncio.sleep(period)
            self.reload()
