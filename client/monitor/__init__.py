"""`swarmlm monitor`: a live view of a swarm in the browser, and the same data as JSON.

- config: MonitorConfig (where to listen, how often to refresh, how long a ping may take)
- watcher: reads the DHT and pings every ONLINE peer (an Info call that must prove the record owner's key) every
  refresh, and keeps the latest document of swarm/dht/state.py
- app: the HTTP server (FastAPI): the page, its script and style, `GET /api/state`
- static/: the page itself, plain HTML, CSS and JavaScript served from here (nothing loaded from elsewhere); it
  builds its DOM from text nodes only, so nothing a peer announces can become markup
- cli: the command (flags, joining the swarm, uvicorn)

It is in `client` because the pings use the client's transport (client/transport.py); what it serves is built in
`swarm` (swarm/dht/state.py), where `swarmlm status --json` builds the same document without pinging.

May import protocol, swarm and the client's core (transport, routing); not client.training or client.demo.
"""
