"""Fixtures of the Azure ML launcher tests: no network, and no real credential or workspace lookup."""

from __future__ import annotations

import errno
import socket

import pytest


def _refuse(*args, **kwargs):
    raise OSError(errno.ENETUNREACH, "network access is blocked in the adasum-aml tests")


def _never(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} was called in an offline test")

    return fail


@pytest.fixture
def no_network(monkeypatch):
    """Block every socket connection and name lookup of this process, and make creating any Azure
    credential (azure-identity, azureml-core authentication) or ``Workspace.from_config`` fail the test."""
    monkeypatch.setattr(socket.socket, "connect", _refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse)
    monkeypatch.setattr(socket, "getaddrinfo", _refuse)
    monkeypatch.setattr(socket, "create_connection", _refuse)
    try:
        import azure.identity as identity

        for name in (
            "DefaultAzureCredential",
            "AzureCliCredential",
            "ManagedIdentityCredential",
            "InteractiveBrowserCredential",
            "EnvironmentCredential",
        ):
            monkeypatch.setattr(getattr(identity, name), "__init__", _never(f"azure.identity.{name}()"))
    except ImportError:
        pass
    try:
        from azureml.core import Workspace, authentication

        for name in (
            "InteractiveLoginAuthentication",
            "AzureCliAuthentication",
            "ServicePrincipalAuthentication",
            "MsiAuthentication",
        ):
            monkeypatch.setattr(getattr(authentication, name), "__init__", _never(f"azureml {name}()"))
        monkeypatch.setattr(Workspace, "from_config", _never("Workspace.from_config"))
        monkeypatch.setattr(Workspace, "__init__", _never("Workspace()"))
    except ImportError:
        pass
    yield
