"""The data pipeline over the archive, on Spark: export to Parquet, delivery report, safe prune.

Only this package imports pyspark (the optional `spark` extra); the relay never loads it."""
