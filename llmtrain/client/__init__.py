"""The CLI's library: AWS sessions (`aws`), the launcher client (`launcher`: start, follow and stop
runs through a team's state machine) and the checks and uploads of datasets (`datasets`). Only the
CLI's commands import it; no Lambda function carries it.
"""
