"""A TLS-terminating reverse proxy with an auth check, as a cluster's ingress puts in front of Prefect and MLflow:
`https://127.0.0.1:<port>/<name>/...` → `<upstream of name>/...`, HTTP and websockets, each name with the one
Authorization header it accepts (anything else: 401, counted). Its certificate is signed by a CA made here, which
clients are given as their CA bundle."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

HOP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding", "authorization", "keep-alive"}


def make_certificates(out: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key) for 127.0.0.1, in PEM."""
    now = dt.datetime.now(dt.UTC)

    def cert(subject: str, key, issuer_name, issuer_key, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        )
        if ca:
            usage = dict(key_cert_sign=True, crl_sign=True, digital_signature=False)
        else:
            usage = dict(key_cert_sign=False, crl_sign=False, digital_signature=True)
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        b = b.add_extension(
            x509.KeyUsage(
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
                **usage,
            ),
            critical=True,
        )
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tidal test CA")])
    ca = cert("tidal test CA", ca_key, ca_name, ca_key, ca=True)
    leaf = cert("127.0.0.1", key, ca_name, ca_key, ca=False)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "ca.pem", out / "server.pem", out / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


@dataclass
class TlsProxy:
    upstreams: dict[str, str]  # name → http://host:port of the real server
    accept: dict[str, str]  # name → the one Authorization header let through
    certs: Path
    passed: Counter = field(default_factory=Counter)  # name → requests let through (websockets included)
    refused: Counter = field(default_factory=Counter)  # name → requests answered 401
    port: int = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _allowed(self, name: str, headers) -> bool:
        ok = name in self.upstreams and headers.get("authorization") == self.accept[name]
        (self.passed if ok else self.refused)[name] += 1
        return ok

    async def _http(self, request: Request) -> Response:
        name, path = request.path_params["name"], request.path_params["path"]
        if not self._allowed(name, request.headers):
            return Response("unauthorized", status_code=401)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.request(
                request.method,
                f"{self.upstreams[name]}/{path}",
                params=list(request.query_params.multi_items()),
                headers=headers,
                content=await request.body(),
            )
        return Response(r.content, r.status_code, {k: v for k, v in r.headers.items() if k.lower() not in HOP})

    async def _websocket(self, ws: WebSocket) -> None:
        from websockets.asyncio.client import connect

        name, path = ws.path_params["name"], ws.path_params["path"]
        if not self._allowed(name, ws.headers):
            await ws.close(code=4401)
            return
        protocols = ws.scope.get("subprotocols") or []
        upstream = self.upstreams[name].replace("http://", "ws://", 1) + f"/{path}"
        async with connect(upstream, subprotocols=protocols or None) as up:
            await ws.accept(subprotocol=up.subprotocol)

            async def inbound() -> None:
                while True:
                    await up.send(await ws.receive_text())

            async def outbound() -> None:
                async for message in up:
                    await ws.send_text(message if isinstance(message, str) else message.decode())

            tasks = [asyncio.create_task(inbound()), asyncio.create_task(outbound())]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # either side closed
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await ws.close()
        except (RuntimeError, WebSocketDisconnect):  # the client had gone already
            pass

    def start(self) -> TlsProxy:
        """Serve in a daemon thread on a free port; returns once it accepts connections."""
        ca, cert, key = make_certificates(self.certs)
        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
        app = Starlette(
            routes=[
                Route("/{name}/{path:path}", self._http, methods=methods),
                WebSocketRoute("/{name}/{path:path}", self._websocket),
            ]
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, ssl_certfile=str(cert), ssl_keyfile=str(key), log_level="warning"
        )
        self._server = uvicorn.Server(config)
        threading.Thread(target=self._server.run, daemon=True, name="tls-proxy").start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the TLS proxy did not start"
            time.sleep(0.05)
        self.ca_file = ca
        return self

    def stop(self) -> None:
        self._server.should_exit = True
