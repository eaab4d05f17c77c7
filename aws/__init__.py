"""The single-host AWS runner: one EC2 GPU host driven over SSM, running the local backend there.

``hobson.aws.runner`` runs on the user's machine (infrastructure, launch, code sync, commands, polling,
status, fetch, teardown); ``hobson.aws.hostrun`` runs on the host (starts the launcher detached and
mirrors its run record, logs and outputs to S3). Every AWS call goes through boto3.
"""
