"""Thin job entry points: build a session, read, chain transforms, write.

Each job is a function taking a :class:`~pyspark.sql.SparkSession` (so tests share one
session and ``spark-submit`` supplies its own) plus plain arguments; ``taproom spark ...``
(``taproom.spark.cli``) parses the command line and calls them.
"""
