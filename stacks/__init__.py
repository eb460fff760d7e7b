"""This app's deployment of the platform: which constructs, wired how, per environment."""

from stacks.access import AccessStack
from stacks.network import NetworkStack
from stacks.platform import PlatformStage, add_platform_stages
from stacks.storage import PINNED_LOGICAL_IDS, StorageStack

__all__ = [
    "PINNED_LOGICAL_IDS",
    "AccessStack",
    "NetworkStack",
    "PlatformStage",
    "StorageStack",
    "add_platform_stages",
]
