"""PySpark data source over the object tier, and the replay job."""
