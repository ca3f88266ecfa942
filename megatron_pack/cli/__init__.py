"""Command-line entry points (`megatron-pack <subcommand> key=value ...`)."""
