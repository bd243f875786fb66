"""Running a job on a Ray cluster: the per-job driver, placement, rank actors and the report
channel.

`python -m workers.driver` (the Ray job entry point) runs `workers.orchestration.driver.main`.
"""
