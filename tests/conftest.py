"""Shared fixtures: every backend-parametrized fixture lives in a sibling module."""

from blob_fixtures import blob, blob_uri, moto_server  # noqa: F401
from consensus_fixtures import consensus, consensus_uri, postgres_url  # noqa: F401
from shard_fixtures import client, location, shard_name  # noqa: F401
