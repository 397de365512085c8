"""Planning layer additions: the job-wide plan (``jobwide``)."""
