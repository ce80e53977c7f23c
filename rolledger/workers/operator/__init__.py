"""What an operator runs and looks at: the command line (`cli`, `cli_events`), `rolledger run` on one machine
(`local_run`) and the distributed processes (`processes`), fault injection (`faults`), the live display
(`progress`), `rolledger ui` (`ui_server`, `ui_page.html`), the timeline drawing, Prometheus metrics and the incident
log on the console.

May import everything below it: rolledger.schemas, rolledger.events, rolledger.workflows and every other workers/
sub-package.
"""
