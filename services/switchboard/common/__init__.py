"""What the process roles and the command line share: constants, flag declarations, model
tasks, the structured-output grammar, TLS files, log limits. Standard library only where the
client install imports it."""
