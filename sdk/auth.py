"""The client's side of SASL/SCRAM (``security.protocol`` SASL_PLAINTEXT or SASL_SSL).

On every new connection, before any other request: SaslHandshake names the mechanism
(``sasl.mechanism``), then two SaslAuthenticate round trips carry ``scramp``'s client-first
and client-final messages; the server's final message is checked too, so a server that does
not hold the user's verifier is not believed. The password's PBKDF2 (``iterations`` rounds,
set by the server's verifier) runs in a worker thread, never on the event loop.

The password is a ``pydantic.SecretStr`` in the config: it does not appear in the config's
repr, in logs or in errors.
"""

from __future__ import annotations

import asyncio
from typing import Any

from scramp import ScramClient, ScramException

from storage.errors import AuthenticationFailedError
from storage.protocol import messages as m


class ScramLogin:
    def __init__(self, mechanism: str, username: str, password: str) -> None:
        self.mechanism = mechanism
        self.username = username
        self._password = password

    def __repr__(self) -> str:
        return f"<ScramLogin {self.mechanism} {self.username}>"

    async def __call__(self, send: Any) -> None:
        shake: m.SaslHandshakeResponse = await send(m.SaslHandshakeRequest(self.mechanism))
        if self.mechanism not in shake.mechanisms:
            raise AuthenticationFailedError(
                f"the agent does not offer {self.mechanism} (it offers {shake.mechanisms})"
            )
        client = ScramClient([self.mechanism], self.username, self._password)
        first: m.SaslAuthenticateResponse = await send(
            m.SaslAuthenticateRequest(client.get_client_first().encode())
        )

        def final(server_first: str) -> str:
            client.set_server_first(server_first)  # PBKDF2: in a worker thread
            return str(client.get_client_final())

        try:
            client_final = await asyncio.to_thread(final, bytes(first.auth_bytes).decode())
        except (ScramException, UnicodeDecodeError) as exc:
            raise AuthenticationFailedError(f"the agent's SCRAM answer is wrong: {exc}") from None
        last: m.SaslAuthenticateResponse = await send(
            m.SaslAuthenticateRequest(client_final.encode())
        )
        try:
            client.set_server_final(bytes(last.auth_bytes).decode())
        except (ScramException, UnicodeDecodeError) as exc:
            raise AuthenticationFailedError(
                f"the agent could not prove it knows the user's verifier: {exc}"
            ) from None
