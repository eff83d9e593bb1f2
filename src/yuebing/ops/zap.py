"""The cluster token on ZeroMQ sockets: ZAP authentication with the PLAIN mechanism (user
``yuebing``, password = the token), so a peer without the token fails the ZMTP handshake and no
message of it ever reaches the socket.

Who calls it: an instance with a cluster token binds its control ROUTER through `serve_plain`
(in a context of its own, which the `TokenAuthenticator` thread serves); every dialer of a
control socket (`instance.client.InstanceClient`: the Conductor, peers, the supervisor's
readiness check) calls `dial_plain` before connecting. A peer without credentials fails at the
mechanism exchange (NULL vs PLAIN); one with a wrong token is denied by the authenticator,
which logs it (never the token) and counts it in ``denied``. Without a token nothing here runs:
sockets stay on the NULL mechanism, as loopback-only clusters use them.
"""

from __future__ import annotations

import hmac
import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

USER = "yuebing"
"""The PLAIN user name every cluster member uses (the token is the password)."""
DOMAIN = "yuebing"


class TokenAuthenticator(ThreadAuthenticator):
    """ZAP handler of one context: admits PLAIN peers whose password is ``token``."""

    def __init__(self, ctx: zmq.Context, token: str) -> None:
        # a sync shadow: the handler's own sockets must be plain zmq ones even when the
        # served sockets belong to a zmq.asyncio context
        super().__init__(zmq.Context.shadow(ctx.underlying), log=log)
        self._token = token.encode()
        self.denied = 0

    def _authenticate_plain(self, domain: str, username: str,
                            password: str) -> tuple[bool, bytes]:
        ok = username == USER and hmac.compare_digest(password.encode(), self._token)
        if not ok:
            self.denied += 1
            if self.denied in (1, 10) or self.denied % 100 == 0:  # a peer retries every 0.1 s
                log.warning("refused a control connection: wrong cluster token (user %r; %d "
                            "refused so far)", username, self.denied)
            return False, b"wrong cluster token"
        return True, b"OK"


def serve_plain(sock: zmq.Socket) -> None:
    """Make ``sock`` (not yet bound) require PLAIN credentials, checked by its context's
    `TokenAuthenticator`."""
    sock.zap_domain = DOMAIN.encode()
    sock.plain_server = True


def dial_plain(sock: zmq.Socket, token: str) -> None:
    """Make ``sock`` (not yet connected) present ``token``."""
    sock.plain_username = USER.encode()
    sock.plain_password = token.encode()
