"""gRPC channels and servers over mutual TLS (or plain text when `tls` is None), and the
identity of the process at the other end of a call."""
from collections.abc import Sequence

import grpc

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
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=list(options))


def sync_channel(address: str, tls: TlsConfig | None, options: Options = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(tls), options=list(options))


def add_port(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


def caller_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The identity in the caller's verified certificate; None on a plain-text server."""
    names = context.auth_context().get("x509_common_name") or ()
    return names[0].decode() if names else None
