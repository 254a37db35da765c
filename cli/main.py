"""The `kvstore` command (placeholder until the CLI issue lands)."""
import click


@click.group()
def cli():
    """kvstore: persistent, resumable LLM generation sessions."""
