"""gRPC channels and servers over mutual TLS (or plain text when `tls` is None), and the
identity of the process at the other end of a call.

A channel checks the server's certificate against the host it dials. A worker found by DNS
discovery is dialled at its pod or container IP, which no certificate names ahead of time (and
a decode worker dials its prefill worker at the address the router passes on): for a
non-loopback IP literal the certificate must instead name `pki.INTERNAL_NAME`, which every
certificate of the deployment's authority carries. The authority is private to the deployment,
and who is at the other end is read from the certificate's identity, not from its address.
"""
import ipaddress
from collections.abc import Sequence

import grpc

from pdserve.common.pki import INTERNAL_NAME
from pdserve.common.tls import TlsConfig

Options = Sequence[tuple[str, object]]


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """A server that answers only callers with a certificate signed by `tls`'s authority."""
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca_cert,
                                       require_client_auth=True)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Present our certificate; trust only servers signed by our authority, at the host named."""
    return grpc.ssl_channel_credentials(root_certificates=tls.ca_cert, private_key=tls.key,
                                        certificate_chain=tls.cert)


def aio_channel(address: str, tls: TlsConfig | None, options: Options = ()) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=secure_options(address, options))


def sync_channel(address: str, tls: TlsConfig | None, options: Options = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(tls), options=secure_options(address, options))


def secure_options(address: str, options: Options = ()) -> list[tuple[str, object]]:
    """`options`, checking the certificate against INTERNAL_NAME when `address` is a
    non-loopback IP literal (see the module's docstring)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        is_remote_ip = not ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_remote_ip = False
    return [*options, ("grpc.ssl_target_name_override", INTERNAL_NAME)] if is_remote_ip else list(options)


def add_port(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


def caller_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The identity in the caller's verified certificate; None on a plain-text server."""
    names = context.auth_context().get("x509_common_name") or ()
    return names[0].decode() if names else None
