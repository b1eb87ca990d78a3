// swarmlm monitor: polls /api/state and draws it. Every value from the swarm becomes a text node or an attribute
// value set through the DOM (never HTML), so nothing a peer announces can turn into markup or script.
"use strict";

(function () {
  const refreshS = Number(document.body.dataset.refreshS) || 5;
  let refreshes = 0;
  let lastOk = null;

  // el("td", {class: "num", title: "..."}, child, ...): children are nodes, or anything else shown as text
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined) continue;
      if (name === "class") node.className = String(value);
      else if (name === "title") node.title = String(value);
      else if (name.startsWith("data-")) node.setAttribute(name, String(value));
      else throw new Error("attribute not allowed: " + name);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function ranges(list) {
    return list.map(([start, end]) => start + ":" + end).join(", ");
  }

  function short(peerId) {
    const text = String(peerId);
    return text.length > 16 ? text.slice(0, 8) + "..." + text.slice(-6) : text;
  }

  function rtt(peer) {
    if (peer.ping === null || peer.ping === undefined) return el("td", {class: "num"}, "-");
    if (peer.ping === "answered") return el("td", {class: "num"}, (Number(peer.rtt_s) * 1000).toFixed(1) + " ms");
    return el("td", {class: "num bad"}, peer.ping);
  }

  function coverage(model) {
    const usable = model.answering || model.coverage;
    const row = el("div", {class: "coverage"});
    usable.forEach((count, block) => {
      const announced = model.coverage[block];
      const kind = count === 0 ? "gap" : count === 1 ? "one" : "many";
      let title = "block " + block + ": " + announced + " ONLINE peer(s) announce it";
      if (model.answering) title += ", " + count + " answer the monitor";
      row.append(el("div", {class: "cell " + kind, title: title, "data-block": block, "data-count": count,
                            "data-announced": announced}, el("span", {class: "num"}, block), count));
    });
    return row;
  }

  function legend() {
    return el("div", {class: "legend"}, "blocks:",
              el("span", {class: "cell gap"}), "no usable peer (gap)",
              el("span", {class: "cell one"}), "one peer",
              el("span", {class: "cell many"}), "two or more");
  }

  function training(model) {
    if (!model.training.length) return null;
    const body = model.training.map((run) => el("tr", {"data-run-id": run.run_id},
      el("td", {}, run.run_id), el("td", {class: "num"}, run.peers),
      el("td", {class: "num"}, run.epoch_min === run.epoch_max ? run.epoch_min : run.epoch_min + "-" + run.epoch_max)));
    return el("div", {class: "training"}, el("h3", {}, "training"),
              el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "run"), el("th", {class: "num"}, "peers"),
                                                  el("th", {class: "num"}, "epoch (updates)"))),
                 el("tbody", {}, ...body)));
  }

  function peers(model) {
    if (!model.peers.length) return el("p", {class: "empty"}, "no peer announces this model");
    const numeric = new Set(["blocks", "throughput", "cache left", "RTT"]);
    const head = ["peer", "state", "blocks", "throughput", "cache left", "dtype", "version", "address", "RTT",
                  "training"].map((name) => el("th", {class: numeric.has(name) ? "num" : null}, name));
    const rows = model.peers.map((peer) => el("tr", {class: peer.state, "data-peer-id": peer.peer_id},
      el("td", {class: "peer", title: peer.peer_id}, short(peer.peer_id)),
      el("td", {class: "state " + peer.state}, peer.state + (peer.live ? "" : " (not counted)")),
      el("td", {class: "num"}, peer.start_block + ":" + peer.end_block),
      el("td", {class: "num"}, Number(peer.throughput).toFixed(1) + " tok/s"),
      el("td", {class: "num"}, peer.cache_tokens_left),
      el("td", {}, peer.quantization && peer.quantization !== "none" ? peer.dtype + ", " + peer.quantization
                                                                      : peer.dtype),
      el("td", {}, peer.version),
      el("td", {}, peer.reach),
      rtt(peer),
      el("td", {}, peer.run_id ? peer.run_id + ": epoch " + peer.epoch + ", " + peer.samples + " samples" : "-")));
    return el("table", {class: "peers"}, el("thead", {}, el("tr", {}, ...head)), el("tbody", {}, ...rows));
  }

  function model(entry) {
    const summary = entry.complete
      ? el("p", {class: "summary complete"}, "all blocks covered")
      : el("p", {class: "summary incomplete"}, "gaps: blocks " + ranges(entry.gaps));
    return el("section", {class: "model", "data-prefix": entry.prefix},
              el("h2", {}, entry.prefix, el("span", {class: "repo"}, entry.repository),
                 el("span", {class: "blocks"}, entry.num_blocks + " blocks")),
              summary, coverage(entry), legend(), training(entry), el("h3", {}, "peers"), peers(entry));
  }

  function setStatus(text, problem) {
    const status = document.getElementById("status");
    status.textContent = text;
    status.className = problem ? "status problem" : "status";
  }

  function render(state) {
    const main = document.getElementById("models");
    const sections = state.models.map(model);
    main.replaceChildren(...(sections.length ? sections : [el("p", {class: "empty"}, "no models announced")]));
    const gaps = state.models.filter((entry) => !entry.complete).length;
    document.title = "swarmlm monitor" + (gaps ? " (" + gaps + " model(s) with gaps)" : "");
    const when = new Date(state.taken_at * 1000).toLocaleTimeString();
    if (state.error) setStatus("the last read failed (" + state.error + "); showing the read of " + when, true);
    else setStatus("read at " + when + ", every " + refreshS + " s" + (state.models_not_read
      ? "; " + state.models_not_read + " less announced model(s) of the index not read" : ""), false);
    refreshes += 1;
    document.body.dataset.refreshes = String(refreshes);
    document.body.dataset.takenAt = String(state.taken_at);
  }

  async function poll() {
    try {
      const response = await fetch("/api/state", {cache: "no-store"});
      if (response.status === 503) {
        setStatus("waiting for the first read of the swarm...", false);
      } else if (!response.ok) {
        throw new Error("HTTP " + response.status);
      } else {
        render(await response.json());
        lastOk = new Date();
      }
    } catch (error) {
      const since = lastOk ? " (last update " + lastOk.toLocaleTimeString() + ")" : "";
      setStatus("update failed: " + error.message + since, true);
    }
    setTimeout(poll, refreshS * 1000);
  }

  poll();
})();
