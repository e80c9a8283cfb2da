"""The fleet tests share the Spark tests' local session (one JVM per test run)."""

from tests.spark.conftest import spark

__all__ = ["spark"]
