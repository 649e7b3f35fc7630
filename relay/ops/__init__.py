"""What runs beside the loop for operators: metrics, the health probes, the watcher that reads the
outbox's gauges, and archive retention."""
