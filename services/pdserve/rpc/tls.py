"""gRPC channels and servers over mutual TLS (or plain text when `tls` is None), and the
identity of the process at the other end of a call.

A channel checks the server's certificate against the name of what it means to reach, not the
host it dials: `pki.WORKER_NAME` for any worker, `pki.PREFILL_WORKER_NAME` for a prefill worker's
KvTransfer service, or that name's `pki.identity_name` for one prefill worker's (a decode worker
told which one it dials). Only a certificate of that role (and identity) names it, so the TLS
handshake itself fails when a router's or a decode worker's certificate, or another prefill
worker's where one was named, answers at a prefill worker's address, and a
worker dialled at a pod or container IP (DNS discovery, the address a router passes on) needs no
certificate naming that IP. The authority is private to the deployment, and who is at the other
end is read from the certificate, not from its address.

A server answers only certificates of its authority, and each method only the roles
`rpc/access.py` allows it.
"""
from collections.abc import Sequence

import grpc

from pdserve.common.tls import TlsConfig
from pdserve.rpc.access import RolePolicy

Options = Sequence[tuple[str, object]]


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """A server that answers only callers with a certificate signed by `tls`'s authority."""
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca_cert,
                                       require_client_auth=True)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Present our certificate; trust only servers signed by our authority."""
    return grpc.ssl_channel_credentials(root_certificates=tls.ca_cert, private_key=tls.key,
                                        certificate_chain=tls.cert)


def aio_channel(address: str, tls: TlsConfig | None, server_name: str, options: Options = ()) -> grpc.aio.Channel:
    """A channel to `address`, whose certificate must name `server_name` (a `pki` name)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=secure_options(server_name, options))


def sync_channel(address: str, tls: TlsConfig | None, server_name: str, options: Options = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(tls), options=secure_options(server_name, options))


def secure_options(server_name: str, options: Options = ()) -> list[tuple[str, object]]:
    """`options`, checking the server's certificate against `server_name` (see the module's docstring)."""
    return [*options, ("grpc.ssl_target_name_override", server_name)]


def aio_server(options: Options = ()) -> grpc.aio.Server:
    """A server whose methods, on a mutual TLS port (`add_port`), answer only the roles
    `rpc/access.py` allows them."""
    return grpc.aio.server(options=list(options), interceptors=[RolePolicy()])


def add_port(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


def caller_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The identity in the caller's verified certificate; None on a plain-text server."""
    names = context.auth_context().get("x509_common_name") or ()
    return names[0].decode() if names else None
