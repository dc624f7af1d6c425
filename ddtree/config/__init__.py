"""The configuration above the engine: server arguments (SGLang flag names), their resolution against
config.json, the memory plan and `ddtree check-config`. Users drive it like SGLang:
`prepare_server_args(argv)` -> resolved `ServerArgs`, or `resolve_server_args(ServerArgs(...))`."""

from ddtree.config.args import ServerArgs, make_parser
from ddtree.config.resolve import prepare_server_args, resolve_server_args
from ddtree.models.configs import ConfigError

__all__ = ["ConfigError", "ServerArgs", "make_parser", "prepare_server_args", "resolve_server_args"]
