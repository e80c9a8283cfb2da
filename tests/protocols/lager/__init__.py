"""Tests for taproom.protocols.lager."""
