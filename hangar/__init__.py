"""The Hangar client: the `hangar` CLI (hangar.cli) and the Python client library it is
built on (hangar.client). Neither imports Django or any of the server's code."""
