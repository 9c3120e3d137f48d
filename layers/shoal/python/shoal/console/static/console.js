// The Shoal console: the HTTP API (same origin, or config.json's api_url) and the WebSocket
// API (config.json's ws_url), with the token the user signs in with. No framework, no build.
// Text from the service or the user is always set as text (textContent), never as HTML.
"use strict";

const TOKEN_KEY = "shoal.console.token";
const WS_KEY = "shoal.console.ws_url";
const MAX_ROWS = 500;
// API Gateway closes a WebSocket idle 10 minutes; a keepalive frame costs no function
const KEEPALIVE_MS = 4 * 60 * 1000;
// API Gateway closes every WebSocket at 2 hours (config.json's max_connection_s): the live
// session moves to a new connection (a renew frame) between one and two times this before
// (a quarter of the lifetime at most), as shoal.client does
const RENEW_BEFORE_S = 5 * 60;
// Acks are held for the delay the page says (300 ms by default, as shoal.client and the API's
// contract: "a few hundred ms at most") and go out together: each ack frame is a billed
// message, an ack invocation and a state write, whatever its number of ids. Sooner when half
// the window waits for its acks or the window is full; as the session closes, at once.
const DEFAULT_ACK_DELAY_MS = 300;
const MAX_ACK_DELAY_MS = 10000;
// ids in one ack frame (the API's limit)
const MAX_ACK_IDS = 1000;
// how long a disconnect waits for the answer to the acks sent before it
const ACK_ANSWER_MS = 5000;

const state = {
  config: { ws_url: "", api_url: "", local_mint: false, max_connection_s: 7200, overview_refresh_s: 60 },
  token: null,
  claims: null,
  ws: null,
  keepalive: null,
  renewal: null,
  // the live session's client id and channel, which a renewal names
  clientId: "",
  channel: "",
  refs: new Map(),
  nextRef: 1,
  subscriptions: new Map(),
  // acks held for the delay (id -> its cell), and the timer that sends them
  heldAcks: new Map(),
  ackTimer: null,
  // QoS 1/2 deliveries received on this session's connections and not acked yet: the window
  // (receive maximum) counts them
  unacked: new Set(),
  receiveMaximum: 100,
  received: 0,
  pushDetailLoads: 0,
  // the Overview's loads (only the last one is drawn) and its refresh timer
  overviewLoads: 0,
  overviewTimer: null,
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function say(id, text) {
  $(id).textContent = text || "";
}

// --- errors: always the API's code and message --------------------------------------------

class ApiError extends Error {
  constructor(status, code, message, body) {
    super(message);
    this.status = status;
    this.code = code;
    this.body = body;
  }
  toString() {
    return `${this.code} (${this.status}): ${this.message}`;
  }
}

function apiError(status, body, response) {
  if (body && body.error && body.error.code) {
    return new ApiError(status, body.error.code, body.error.message || "", body);
  }
  // API Gateway's own answers ({"message": ...}): 401 from the JWT authorizer, 413, 429, 504
  const message = body && body.message ? body.message : `HTTP ${status}`;
  if (status === 401) {
    const why = response && response.headers.get("www-authenticate");
    return new ApiError(401, "unauthorized",
      `${message}: the token was refused${why ? ` (${why})` : ""}. Sign in again with a valid token.`, body);
  }
  return new ApiError(status, `http_${status}`, message, body);
}

// A refusal of an admin view says why, rather than showing an empty page.
function explain(error) {
  if (!(error instanceof ApiError)) return `${error.name || "error"}: ${error.message || error}`;
  let text = error.toString();
  if (error.status === 403 && error.code === "forbidden") {
    const sub = state.claims ? state.claims.sub : "?";
    text += state.claims && state.claims["shoal:admin"] === true
      ? ` — the token of ${sub} is not allowed this.`
      : ` — this view needs an admin token (claim shoal:admin true); the token of ${sub} is not one.`;
  }
  return text;
}

async function api(method, path, body, headers) {
  const init = { method, headers: { Authorization: `Bearer ${state.token}`, ...(headers || {}) } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(state.config.api_url + path, init);
  } catch (exc) {
    throw new ApiError(0, "network_error", `the HTTP API cannot be reached (${exc.message})`);
  }
  const text = await response.text();
  let parsed = null;
  try {
    parsed = text ? JSON.parse(text) : null;
  } catch (_exc) {
    parsed = { message: text.slice(0, 200) };
  }
  if (!response.ok) throw apiError(response.status, parsed, response);
  return parsed;
}

// --- payloads ---------------------------------------------------------------------------

function b64ToBytes(text) {
  const raw = atob(text || "");
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

function bytesToB64(bytes) {
  let raw = "";
  for (const b of bytes) raw += String.fromCharCode(b);
  return btoa(raw);
}

function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join(" ");
}

// Text when the bytes are UTF-8 without control characters (tabs and newlines aside), else hex.
function showPayload(b64) {
  const bytes = b64ToBytes(b64);
  try {
    const text = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
    // eslint-disable-next-line no-control-regex
    if (!/[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f]/.test(text)) return { kind: "text", value: text };
  } catch (_exc) {
    // not UTF-8: hex below
  }
  return { kind: "hex", value: hex(bytes) };
}

function payloadBytes(text, format) {
  if (format === "hex") {
    const digits = text.replace(/\s+/g, "");
    if (digits.length % 2 || /[^0-9a-fA-F]/.test(digits)) throw new Error("not hex: pairs of 0-9 a-f");
    const bytes = new Uint8Array(digits.length / 2);
    for (let i = 0; i < bytes.length; i++) bytes[i] = parseInt(digits.slice(2 * i, 2 * i + 2), 16);
    return bytes;
  }
  if (format === "base64") {
    try {
      return b64ToBytes(text.trim());
    } catch (_exc) {
      throw new Error("not base64");
    }
  }
  return new TextEncoder().encode(text);
}

// --- sign in ------------------------------------------------------------------------------

function decodeClaims(token) {
  const parts = token.split(".");
  if (parts.length !== 3) throw new Error("a JWT has three dot-separated parts");
  const b64 = parts[1].replace(/-/g, "+").replace(/_/g, "/");
  const json = new TextDecoder().decode(b64ToBytes(b64 + "=".repeat((4 - (b64.length % 4)) % 4)));
  const claims = JSON.parse(json);
  if (!claims || typeof claims.sub !== "string") throw new Error("the token has no sub claim");
  return claims;
}

function signIn(token) {
  token = token.trim().replace(/^Bearer\s+/i, "");
  let claims;
  try {
    claims = decodeClaims(token);
  } catch (exc) {
    say("token-error", `invalid_token: ${exc.message}`);
    return false;
  }
  if (typeof claims.exp === "number" && claims.exp * 1000 <= Date.now()) {
    say("token-error", `expired_token: the token expired at ${new Date(claims.exp * 1000).toISOString()}; mint or paste a new one`);
    return false;
  }
  say("token-error", "");
  state.token = token;
  state.claims = claims;
  sessionStorage.setItem(TOKEN_KEY, token);
  const expires = claims.exp ? new Date(claims.exp * 1000).toISOString() : "never";
  const admin = claims["shoal:admin"] === true ? ", admin" : "";
  say("who", `Signed in as ${claims.sub}${admin}; the token expires ${expires}`);
  $("signin").hidden = true;
  $("views").hidden = false;
  $("signout").hidden = false;
  $("client-id").value = defaultClientId(claims);
  if (claims["shoal:admin"] === true) {
    // an admin's first page is the picture of the system
    show("overview");
    $("overview-title").focus();
  } else {
    show("live");
    // keyboard users go on where the next step is
    $("connect").focus();
  }
  return true;
}

function defaultClientId(claims) {
  const patterns = claims["shoal:clients"];
  const suffix = Math.random().toString(36).slice(2, 8);
  if (Array.isArray(patterns)) {
    const wild = patterns.find((p) => p.endsWith("*"));
    if (wild) return `${wild.slice(0, -1)}${wild.length > 1 ? "-" : ""}${suffix}`;
    if (patterns.length) return patterns[0];
  }
  return claims.sub;
}

function signOut() {
  closeSocket("signed out");
  stopOverviewTimer();
  // a load still on its way is drawn nowhere
  state.overviewLoads += 1;
  clearOverview();
  say("overview-error", "");
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = null;
  state.claims = null;
  say("who", "Not signed in");
  $("views").hidden = true;
  $("signout").hidden = true;
  for (const section of document.querySelectorAll("main > section")) section.hidden = true;
  $("signin").hidden = false;
  $("token").value = "";
  $("token").focus();
}

async function mintLocal(event) {
  event.preventDefault();
  say("mint-error", "");
  const words = (id) => $(id).value.split(/\s+/).filter(Boolean);
  const body = {
    sub: $("mint-sub").value.trim(),
    admin: $("mint-admin").checked,
    publish: words("mint-publish"),
    subscribe: words("mint-subscribe"),
  };
  if (words("mint-clients").length) body.clients = words("mint-clients");
  try {
    const response = await fetch(state.config.api_url + "/_shoal/token", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    const answer = await response.json().catch(() => null);
    if (!response.ok) throw apiError(response.status, answer, response);
    signIn(answer.token);
  } catch (exc) {
    say("mint-error", explain(exc));
  }
}

// --- views --------------------------------------------------------------------------------

const loaders = {
  overview: () => loadOverview(false),
  topics: loadTopics,
  push: loadPushSubscriptions,
};

function show(view) {
  for (const button of document.querySelectorAll("#views button")) {
    if (button.dataset.view === view) button.setAttribute("aria-current", "page");
    else button.removeAttribute("aria-current");
  }
  for (const section of document.querySelectorAll("main > section")) {
    section.hidden = section.id !== view;
  }
  // the Overview refreshes only while it is shown
  if (view !== "overview") stopOverviewTimer();
  if (loaders[view]) loaders[view]();
}

// --- overview (admin) ---------------------------------------------------------------------
// GET /v1/metrics: the stack's metrics for a time range (one CloudWatch query a view), drawn
// as SVG charts by this page (nothing loaded from elsewhere). Every figure is text too: each
// chart's legend says its totals and latest values, and the current figures are a list.

const RANGE_KEY = "shoal.console.range";
const RANGE_WORDS = { "15m": "the last 15 minutes", "1h": "the last hour", "1d": "the last day" };
const SVG_NS = "http://www.w3.org/2000/svg";
const CHART = { width: 640, height: 230, left: 64, right: 16, top: 14, bottom: 46 };
// how each unit is drawn and said
const UNITS = {
  per_second: { axis: "per second", scale: 1, say: (v) => `${number(v)}/s` },
  per_minute: { axis: "per minute", scale: 1, say: (v) => `${number(v)}/min` },
  count: { axis: "count", scale: 1, say: (v) => number(v) },
  ms: { axis: "seconds", scale: 1 / 1000, say: (v) => `${number(v)} s` },
};

function number(value) {
  if (value === null || value === undefined) return "no data";
  const abs = Math.abs(value);
  const digits = abs >= 100 || Number.isInteger(value) ? 0 : abs >= 10 ? 1 : abs >= 1 ? 2 : 3;
  return value.toLocaleString("en", { maximumFractionDigits: digits });
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, String(value));
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

// the value axis: a step of 1, 2 or 5 times a power of ten (a whole one for counts of
// things), and as many steps as reach the largest value, four or so
function valueAxis(max, whole) {
  if (!(max > 0)) return { top: whole ? 4 : 1, step: whole ? 1 : 0.25 };
  const rough = max / 4;
  const power = 10 ** Math.floor(Math.log10(rough));
  let step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= rough);
  if (whole) step = Math.max(1, Math.ceil(step));
  return { top: Math.ceil(max / step - 1e-9) * step, step };
}

function clock(ms, withDate) {
  const d = new Date(ms);
  const time = d.toLocaleTimeString("en-GB", { hour: "2-digit", minute: "2-digit" });
  return withDate ? `${d.toLocaleDateString("en-GB", { day: "numeric", month: "short" })} ${time}` : time;
}

function utcOffset() {
  const minutes = -new Date().getTimezoneOffset();
  const sign = minutes < 0 ? "-" : "+";
  const abs = Math.abs(minutes);
  return `UTC${sign}${String(Math.floor(abs / 60)).padStart(2, "0")}:${String(abs % 60).padStart(2, "0")}`;
}

// one chart: a figure with its title, the SVG drawing (axes, units and time labelled) and a
// legend that says every series' figures in words
function drawChart(chart, view) {
  const unit = UNITS[chart.unit] || UNITS.count;
  const { width, height, left, right, top, bottom } = CHART;
  const plotW = width - left - right;
  const plotH = height - top - bottom;
  const stamps = view.timestamps;
  const periodMs = view.period_s * 1000;
  const t0 = stamps[0];
  const t1 = stamps[stamps.length - 1] + periodMs;
  const x = (t) => left + ((t + periodMs / 2 - t0) / (t1 - t0)) * plotW;
  const scaled = chart.series.map((s) => s.values.map((v) => (v === null ? null : v * unit.scale)));
  const axis = valueAxis(Math.max(0, ...scaled.flat().filter((v) => v !== null)), chart.unit === "count");
  const y = (v) => top + plotH - (v / axis.top) * plotH;
  const titleId = `chart-${chart.id}-title`;
  const descId = `chart-${chart.id}-desc`;
  const period = view.period_s === 60 ? "a point a minute" : `a point every ${view.period_s / 60} minutes`;
  const drawing = svg("svg", {
    viewBox: `0 0 ${width} ${height}`,
    role: "img",
    "aria-labelledby": titleId,
    "aria-describedby": descId,
    focusable: "false",
    class: "chart-svg",
  });
  // the grid and the value axis: a labelled line each step
  for (let i = 0; i * axis.step <= axis.top + 1e-9; i++) {
    const value = i * axis.step;
    const at = y(value);
    drawing.append(
      svg("line", { x1: left, x2: width - right, y1: at, y2: at, class: i ? "grid" : "axis" }),
      svg("text", { x: left - 6, y: at + 4, class: "tick", "text-anchor": "end", text: number(value) }));
  }
  drawing.append(svg("line", { x1: left, x2: left, y1: top, y2: top + plotH, class: "axis" }));
  // the time axis: labelled instants on round minutes or hours (of the local time)
  const longRange = t1 - t0 > 6 * 3600 * 1000;
  const at = (t) => left + ((t - t0) / (t1 - t0)) * plotW;
  const offset = new Date(t0).getTimezoneOffset() * 60 * 1000;
  const every = [1, 2, 5, 10, 15, 30, 60, 120, 180, 240, 360].map((m) => m * 60 * 1000)
    .find((ms) => (t1 - t0) / ms <= 6);
  let first = true;
  for (let t = Math.ceil((t0 - offset) / every) * every + offset; t <= t1; t += every) {
    const px = at(t);
    drawing.append(
      svg("line", { x1: px, x2: px, y1: top + plotH, y2: top + plotH + 4, class: "axis" }),
      svg("text", { x: px, y: top + plotH + 16, class: "tick", "text-anchor": "middle", text: clock(t, longRange && first) }));
    first = false;
  }
  drawing.append(
    svg("text", { x: left + plotW / 2, y: height - 6, class: "axis-title", "text-anchor": "middle", text: `time (${utcOffset()}), ${period}` }),
    svg("text", { x: 14, y: top + plotH / 2, class: "axis-title", "text-anchor": "middle", transform: `rotate(-90 14 ${top + plotH / 2})`, text: unit.axis }));
  // the lines: a lag without data is a gap (no batch ran); a level (a count of things, from
  // the census) is joined across the periods between two censuses; a lone point is a dot
  const joinGaps = chart.unit === "count";
  chart.series.forEach((series, n) => {
    const values = scaled[n];
    let d = "";
    const dots = [];
    let seen = false;
    values.forEach((v, i) => {
      if (v === null) return;
      const px = x(stamps[i]).toFixed(1);
      const py = y(v).toFixed(1);
      const joined = joinGaps ? seen : i > 0 && values[i - 1] !== null;
      d += `${joined ? "L" : "M"}${px} ${py} `;
      const next = joinGaps ? values.slice(i + 1).some((w) => w !== null) : values[i + 1] !== null && i < values.length - 1;
      if (!joined && !next) dots.push(svg("circle", { cx: px, cy: py, r: 3 }));
      seen = true;
    });
    const points = values.filter((v) => v !== null).length;
    drawing.append(svg("g", { class: `series s${n % 6}`, "data-series": series.id, "data-points": points },
      svg("path", { d: d.trim() }), ...dots));
  });
  const legend = el("ul", { class: "legend" }, ...chart.series.map((series, n) => {
    const peak = series.values.reduce((m, v) => (v === null ? m : Math.max(m ?? v, v)), null);
    const parts = [];
    if (series.total !== null && series.total !== undefined) {
      parts.push(el("span", {}, " ", el("strong", { class: "total", text: number(series.total) }), ` in ${RANGE_WORDS[view.range]};`));
    }
    parts.push(el("span", { class: "latest", text: ` latest ${unit.say(series.latest === null ? null : series.latest * unit.scale)}` }));
    if (peak !== null) parts.push(el("span", { class: "peak", text: `, peak ${unit.say(peak * unit.scale)}` }));
    return el("li", { "data-series": series.id },
      el("span", { class: `swatch s${n % 6}`, "aria-hidden": "true" }),
      el("span", { class: "name", text: series.label }), ":", ...parts);
  }));
  if (!chart.series.length) legend.append(el("li", { text: "Nothing to draw: no push subscriptions." }));
  const words = chart.series.map((s) => `${s.label} ${unit.say(s.latest === null ? null : s.latest * unit.scale)}`).join("; ");
  drawing.prepend(svg("desc", { id: descId, text: `${chart.title}, ${unit.axis}, over ${RANGE_WORDS[view.range]}. Latest: ${words || "none"}.` }));
  return el("figure", { class: "chart", "data-chart": chart.id },
    el("figcaption", {}, el("span", { class: "chart-title", id: titleId, text: `${chart.title} (${unit.axis})` })),
    drawing, legend);
}

function overviewRange() {
  const checked = document.querySelector('input[name="overview-range"]:checked');
  return checked ? checked.value : "1h";
}

// what an admin's view showed goes with a sign-out or a refusal: the next token may not see it
function clearOverview() {
  $("overview-charts").replaceChildren();
  $("overview-figures").replaceChildren();
  $("overview-functions").tBodies[0].replaceChildren();
  say("overview-updated", "");
}

function stopOverviewTimer() {
  clearTimeout(state.overviewTimer);
  state.overviewTimer = null;
}

function scheduleOverview() {
  stopOverviewTimer();
  if ($("overview").hidden || !$("overview-auto").checked || document.hidden) return;
  const every = Number(state.config.overview_refresh_s) || 60;
  state.overviewTimer = setTimeout(() => loadOverview(false), every * 1000);
}

async function loadOverview(announce) {
  stopOverviewTimer();
  const load = ++state.overviewLoads;
  const range = overviewRange();
  const charts = $("overview-charts");
  charts.setAttribute("aria-busy", "true");
  try {
    const view = await api("GET", `/v1/metrics?range=${encodeURIComponent(range)}`);
    if (load !== state.overviewLoads) return;
    say("overview-error", "");
    charts.replaceChildren(...view.charts.map((c) => drawChart(c, view)));
    const latest = (chartId, seriesId) => {
      const chart = view.charts.find((c) => c.id === chartId);
      const series = chart && chart.series.find((s) => s.id === seriesId);
      return series ? number(series.latest) : "no data";
    };
    const f = view.figures;
    const census = f.groups === null ? "no census yet" : String(f.groups);
    $("overview-figures").replaceChildren(
      el("dt", { text: "Topics" }), el("dd", { id: "figure-topics", text: String(f.topics) }),
      el("dt", { text: "Storage topics" }), el("dd", { id: "figure-storage-topics", text: String(f.storage_topics) }),
      el("dt", { text: "Push subscriptions" }), el("dd", { id: "figure-push-subscriptions", text: String(f.push_subscriptions) }),
      el("dt", { text: "Shared groups" }), el("dd", { id: "figure-groups", text: census }),
      el("dt", { text: "WebSocket connections" }), el("dd", { id: "figure-connections", text: latest("connections", "connections") }),
      el("dt", { text: "Connected sessions" }), el("dd", { id: "figure-sessions", text: latest("connections", "sessions") }));
    say("overview-functions-caption", `Errors and throttles by function, ${RANGE_WORDS[view.range]}`);
    $("overview-functions").tBodies[0].replaceChildren(...view.functions.map((r) => el("tr", { "data-function": r.function },
      el("th", { scope: "row", class: "mono", text: r.function }),
      el("td", { text: String(r.errors) }), el("td", { text: String(r.throttles) }))));
    const every = Number(state.config.overview_refresh_s) || 60;
    const auto = $("overview-auto").checked ? `; refreshes every ${every} s` : "";
    say("overview-updated", `Showing ${RANGE_WORDS[view.range]} (${clock(Date.parse(view.start), true)} to ${clock(Date.parse(view.end), true)}), updated at ${new Date().toLocaleTimeString("en-GB")}${auto}`);
    // said aloud when the user asked for it, not at every refresh by itself
    if (announce) say("overview-status", `Overview of ${RANGE_WORDS[view.range]} updated`);
    scheduleOverview();
  } catch (exc) {
    if (load !== state.overviewLoads) return;
    say("overview-error", explain(exc));
    // a refusal stays a refusal: no more tries until the user asks
    if (!(exc instanceof ApiError && exc.status === 403)) scheduleOverview();
    else clearOverview();
  } finally {
    if (load === state.overviewLoads) charts.removeAttribute("aria-busy");
  }
}

// --- live: the WebSocket session --------------------------------------------------------

function send(frame) {
  return sendOn(state.ws, frame);
}

function sendOn(ws, frame) {
  if (!ws || ws.readyState !== WebSocket.OPEN) {
    return Promise.reject(new ApiError(0, "not_connected", "connect a session first"));
  }
  const ref = `c${state.nextRef++}`;
  return new Promise((resolve, reject) => {
    state.refs.set(ref, { resolve, reject, ws, frame });
    ws.send(JSON.stringify({ ...frame, ref }));
  });
}

// a renewal closes the old connection: what was sent on it and not answered yet would wait
// forever (its answer goes to a closed connection). An ack is sent again on the new one (an
// ack of an id already acked acks nothing: it is safe twice), so a message acked just before
// the renewal is not delivered again with dup; anything else is refused, to be tried again.
function carryOver(old, ws) {
  for (const [ref, waiting] of state.refs) {
    if (waiting.ws !== old) continue;
    state.refs.delete(ref);
    if (waiting.frame.action === "ack") {
      sendOn(ws, waiting.frame).then(waiting.resolve, waiting.reject);
    } else {
      waiting.reject(new ApiError(0, "connection_renewed", "the connection was renewed before the answer came; try again"));
    }
  }
}

function setConnected(connected, text) {
  say("connection", text);
  $("connect").disabled = connected;
  $("disconnect").disabled = !connected;
  $("subscribe").disabled = !connected;
}

function openSocket(url) {
  // browsers cannot set Authorization on a WebSocket: the token is offered as a subprotocol
  const ws = new WebSocket(url, ["shoal.v1", `bearer.${state.token}`]);
  ws.addEventListener("message", (event) => onFrame(event.data));
  return ws;
}

// the connect frame (MQTT's CONNECT) with the form's session expiry and receive maximum
function connectFrame(clientId, cleanStart) {
  return {
    action: "connect",
    client_id: clientId,
    clean_start: cleanStart,
    session_expiry_s: Number($("session-expiry").value || 0),
    receive_maximum: Number($("receive-maximum").value || 100),
  };
}

function connect(event) {
  event.preventDefault();
  say("connection-error", "");
  say("renewed", "");
  closeSocket("reconnecting");
  const url = $("ws-url").value.trim();
  sessionStorage.setItem(WS_KEY, url);
  let ws;
  try {
    ws = openSocket(url);
  } catch (exc) {
    say("connection-error", `invalid_url: ${exc.message}`);
    return;
  }
  state.ws = ws;
  let answered = false;
  setConnected(true, `Connecting to ${url} …`);
  ws.addEventListener("open", async () => {
    const frame = connectFrame($("client-id").value.trim(), $("clean-start").checked);
    try {
      const answer = await send(frame);
      answered = true;
      state.clientId = frame.client_id;
      // what was in flight before comes again (dup) on this connection, to be acked again
      state.unacked.clear();
      live(ws, url, answer);
      setConnected(true,
        `Connected as ${frame.client_id} (session present: ${answer.session_present}, receive maximum ${answer.receive_maximum})`);
      $("filter").focus();
    } catch (exc) {
      say("connection-error", explain(exc));
      ws.close(1000);
    }
  });
  ws.addEventListener("close", (event) => closed(ws, event, answered));
}

// the connection holding the live session now: its keepalives, and its renewal before its end
function live(ws, url, answer) {
  state.channel = answer.channel || "";
  state.receiveMaximum = Number(answer.receive_maximum) || 100;
  clearInterval(state.keepalive);
  clearTimeout(state.renewal);
  state.keepalive = setInterval(() => {
    if (ws.readyState === WebSocket.OPEN) ws.send('{"action":"keepalive"}');
  }, KEEPALIVE_MS);
  const lifetime = Number(state.config.max_connection_s) || 7200;
  const before = Math.min(RENEW_BEFORE_S, lifetime / 4) * (1 + Math.random());
  state.renewal = setTimeout(() => renew(ws, url), (lifetime - before) * 1000);
}

// make-before-break: the new connection's renew moves the live channel over (what is in flight
// stays, no will); the old one is closed once that is answered, with no disconnect frame
function renew(old, url) {
  if (state.ws !== old) return;
  let ws;
  try {
    ws = openSocket(url);
  } catch (_exc) {
    return; // the old connection serves until its end
  }
  ws.addEventListener("open", async () => {
    let answer;
    try {
      answer = await sendOn(ws, { action: "renew", client_id: state.clientId, channel: state.channel });
    } catch (exc) {
      if (exc.code !== "renew_refused" || state.ws !== old) {
        ws.close(1000);
        return;
      }
      // the old connection lost the channel meanwhile: the session is resumed instead
      try {
        answer = await sendOn(ws, connectFrame(state.clientId, false));
      } catch (again) {
        say("connection-error", explain(again));
        ws.close(1000);
        return;
      }
    }
    if (state.ws !== old) {
      ws.close(1000);
      return;
    }
    state.ws = ws;
    live(ws, url, answer);
    carryOver(old, ws);
    old.close(1000, "renewed");
    say("renewed", `Connection renewed at ${new Date().toLocaleTimeString()}`);
  });
  ws.addEventListener("close", (event) => closed(ws, event, true));
}

function closed(ws, event, answered) {
  if (state.ws !== ws) return;
  clearInterval(state.keepalive);
  clearTimeout(state.renewal);
  state.ws = null;
  const lost = new ApiError(0, "connection_closed", "the connection closed");
  for (const { reject } of state.refs.values()) reject(lost);
  state.refs.clear();
  // held acks are not sent: their messages come again (dup) when the session resumes
  dropHeldAcks(explain(lost));
  setConnected(false, `Not connected (closed ${event.code}${event.reason ? `: ${event.reason}` : ""})`);
  if (!answered && event.code === 1006 && !$("connection-error").textContent) {
    // the browser tells a page nothing of a refused handshake (401, 403): only 1006
    say("connection-error",
      "handshake_failed (1006): the WebSocket API refused the handshake or cannot be reached — check the token and the URL.");
  }
}

async function closeSocket(why) {
  if (!state.ws) return;
  const ws = state.ws;
  state.ws = null;
  clearInterval(state.keepalive);
  clearTimeout(state.renewal);
  setConnected(false, "Not connected");
  if (ws.readyState === WebSocket.OPEN) {
    // the held acks first, answered: API Gateway runs a connection's frames in no set order,
    // and a disconnect that overtook them would leave them refused (their messages would
    // come again)
    await ackBeforeClosing(ws);
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ action: "disconnect" }));
  } else {
    dropHeldAcks("not acked: the connection closed");
  }
  ws.close(1000, why);
}

function onFrame(data) {
  let frame;
  try {
    frame = JSON.parse(data);
  } catch (_exc) {
    say("connection-error", `bad_frame: the service sent a frame that is not JSON`);
    return;
  }
  if (frame.action === "message") {
    addMessage(frame);
    return;
  }
  const waiting = frame.ref ? state.refs.get(frame.ref) : undefined;
  if (waiting) {
    state.refs.delete(frame.ref);
    if (frame.action === "error") {
      waiting.reject(new ApiError(frame.status, frame.error.code, frame.error.message, frame));
    } else {
      waiting.resolve(frame);
    }
    return;
  }
  if (frame.action === "error") {
    say("connection-error", new ApiError(frame.status, frame.error.code, frame.error.message).toString());
  } else if (frame.action === "disconnect") {
    say("connection-error", `disconnected by the service: ${frame.reason}`);
  }
}

async function subscribe(event) {
  event.preventDefault();
  say("filter-error", "");
  const filter = $("filter").value.trim();
  const qos = Number($("sub-qos").value);
  try {
    const answer = await send({ action: "subscribe", subscriptions: [{ filter, qos }] });
    const granted = answer.granted[0];
    if (typeof granted === "string") {
      say("filter-error", `${granted}: the service did not grant ${filter}`);
      return;
    }
    state.subscriptions.set(filter, granted);
    renderSubscriptions();
    $("filter").value = "";
  } catch (exc) {
    say("filter-error", explain(exc));
  }
}

async function unsubscribe(filter) {
  try {
    await send({ action: "unsubscribe", filters: [filter] });
    state.subscriptions.delete(filter);
    renderSubscriptions();
  } catch (exc) {
    say("connection-error", explain(exc));
  }
}

function renderSubscriptions() {
  const list = $("subscriptions");
  list.replaceChildren();
  for (const [filter, qos] of state.subscriptions) {
    list.append(el("li", {}, el("code", { text: filter }), ` QoS ${qos} `,
      el("button", { type: "button", "aria-label": `Unsubscribe from ${filter}`, onclick: () => unsubscribe(filter) }, "Unsubscribe")));
  }
}

function addMessage(frame) {
  state.received += 1;
  say("message-count", String(state.received));
  const payload = showPayload(frame.payload);
  const props = frame.properties && Object.keys(frame.properties).length ? JSON.stringify(frame.properties) : "";
  const ackCell = el("td", { class: "ack" });
  const row = el("tr", { "data-id": frame.id, "data-topic": frame.topic },
    el("td", { text: new Date(frame.published_at).toISOString() }),
    el("td", { class: "topic-name mono", text: frame.topic }),
    el("td", { class: "payload" }, el("span", { class: "kind", text: payload.kind }), el("span", { class: "value", text: payload.value })),
    el("td", { text: String(frame.qos) }),
    el("td", { text: frame.retain ? "yes" : "no" }),
    el("td", { text: frame.dup ? "yes" : "no" }),
    el("td", { class: "mono", text: frame.subscription }),
    el("td", { class: "mono", text: props }),
    ackCell);
  const body = $("messages").tBodies[0];
  body.prepend(row);
  while (body.rows.length > MAX_ROWS) body.deleteRow(-1);
  if (frame.qos > 0) state.unacked.add(frame.id);
  if (frame.qos === 0) {
    ackCell.textContent = "not needed";
  } else if ($("auto-ack").checked) {
    ack(frame.id, ackCell);
  } else {
    ackCell.append(el("button", { type: "button", "aria-label": `Ack the message on ${frame.topic}`, onclick: () => ack(frame.id, ackCell) }, "Ack"));
  }
}

function ackDelayMs() {
  const value = Number($("ack-delay").value);
  if ($("ack-delay").value === "" || !Number.isFinite(value)) return DEFAULT_ACK_DELAY_MS;
  return Math.min(Math.max(value, 0), MAX_ACK_DELAY_MS);
}

// the ack is held for the delay, with those held already
function ack(id, cell) {
  cell.textContent = "acking…";
  state.heldAcks.set(id, cell);
  const half = Math.max(1, Math.floor(state.receiveMaximum / 2));
  // sooner: half the window waits for its acks, or the window is full (nothing more comes
  // until an ack does)
  if (ackDelayMs() === 0 || state.heldAcks.size >= half || state.unacked.size >= state.receiveMaximum) {
    flushAcks();
  } else if (state.ackTimer === null) {
    state.ackTimer = setTimeout(flushAcks, ackDelayMs());
  }
}

function takeHeldAcks() {
  clearTimeout(state.ackTimer);
  state.ackTimer = null;
  const held = [...state.heldAcks];
  state.heldAcks.clear();
  const batches = [];
  for (let at = 0; at < held.length; at += MAX_ACK_IDS) batches.push(held.slice(at, at + MAX_ACK_IDS));
  for (const batch of batches) for (const [id] of batch) state.unacked.delete(id);
  return batches;
}

// the held acks, one frame per 1000 ids, each answered (a ref): its cells say so
function flushAcks() {
  for (const batch of takeHeldAcks()) {
    send({ action: "ack", ids: batch.map(([id]) => id) }).then(
      () => { for (const [, cell] of batch) cell.textContent = "acked"; },
      (exc) => { for (const [, cell] of batch) cell.textContent = explain(exc); });
  }
}

// the session is closing: the held acks go now, and their answers are waited for (a few
// seconds at most: a connection that broke meanwhile answers nothing)
function ackBeforeClosing(ws) {
  const answered = takeHeldAcks().map((batch) => {
    const acked = sendOn(ws, { action: "ack", ids: batch.map(([id]) => id) }).then(
      () => { for (const [, cell] of batch) cell.textContent = "acked"; },
      (exc) => { for (const [, cell] of batch) cell.textContent = explain(exc); });
    const late = new Promise((resolve) => setTimeout(() => {
      for (const [, cell] of batch) if (cell.textContent === "acking…") cell.textContent = "no answer to the ack";
      resolve();
    }, ACK_ANSWER_MS));
    return Promise.race([acked, late]);
  });
  return Promise.all(answered);
}

function dropHeldAcks(why) {
  for (const batch of takeHeldAcks()) for (const [, cell] of batch) cell.textContent = why;
  state.unacked.clear();
}

// --- publish ------------------------------------------------------------------------------

const PUBLISH_FIELDS = {
  invalid_topic: "pub-topic-error",
  topic_not_found: "pub-topic-error",
  forbidden: "pub-topic-error",
  invalid_payload: "pub-payload-error",
  payload_too_large: "pub-payload-error",
};

async function publish(event) {
  event.preventDefault();
  for (const id of ["pub-topic-error", "pub-payload-error", "pub-user-properties-error", "publish-error"]) say(id, "");
  say("publish-answer", "");
  const body = {
    topic: $("pub-topic").value,
    qos: Number($("pub-qos").value),
    retain: $("pub-retain").checked,
  };
  const format = $("pub-format").value;
  try {
    if (format === "text") body.text = $("pub-payload").value;
    else body.payload = bytesToB64(payloadBytes($("pub-payload").value, format));
  } catch (exc) {
    say("pub-payload-error", `invalid_payload: ${exc.message}`);
    return;
  }
  const key = $("pub-ordering-key").value;
  if (key) body.ordering_key = key;
  const properties = {};
  if ($("pub-content-type").value) properties.content_type = $("pub-content-type").value;
  if ($("pub-expiry").value !== "") properties.message_expiry_s = Number($("pub-expiry").value);
  const lines = $("pub-user-properties").value.split("\n").filter((l) => l.trim());
  if (lines.length) {
    properties.user_properties = {};
    for (const line of lines) {
      const at = line.indexOf("=");
      if (at < 1) {
        say("pub-user-properties-error", `invalid_properties: "${line}" is not name=value`);
        return;
      }
      properties.user_properties[line.slice(0, at).trim()] = line.slice(at + 1);
    }
  }
  if (Object.keys(properties).length) body.properties = properties;
  try {
    const answer = await api("POST", "/v1/messages", body);
    say("publish-answer", JSON.stringify(answer, null, 2));
  } catch (exc) {
    const field = exc instanceof ApiError ? PUBLISH_FIELDS[exc.code] : undefined;
    say(field || "publish-error", explain(exc));
    if (field) $(field.replace(/-error$/, "")).focus();
  }
}

// --- topics (admin) -----------------------------------------------------------------------

async function loadTopics() {
  say("topics-error", "");
  const list = $("topics-list");
  list.setAttribute("aria-busy", "true");
  try {
    const answer = await api("GET", "/v1/topics");
    list.replaceChildren(...answer.topics.map(renderTopic));
    if (!answer.topics.length) list.append(el("p", { text: "No topics." }));
  } catch (exc) {
    list.replaceChildren();
    say("topics-error", explain(exc));
  } finally {
    list.removeAttribute("aria-busy");
  }
}

function renderTopic(topic) {
  const rows = topic.storage_topics.map((s) => el("tr", {},
    el("td", { text: String(s.index) }), el("td", { class: "mono", text: s.stream }),
    el("td", { text: String(s.partitions) }), el("td", { text: String(s.k) }),
    el("td", { text: s.index === topic.produce_pointer ? "yes" : "" })));
  const growId = `grow-${topic.name}`;
  const error = el("p", { class: "error", role: "alert" });
  const grow = el("form", { class: "row", onsubmit: async (event) => {
    event.preventDefault();
    const partitions = Number(event.target.elements.partitions.value);
    if (!confirm(`Append a storage topic of ${partitions} partitions to ${topic.name}?`)) return;
    try {
      await api("POST", `/v1/topics/${encodeURIComponent(topic.name)}/storage-topics`, { partitions });
      loadTopics();
    } catch (exc) {
      error.textContent = explain(exc);
    }
  } },
  el("div", {}, el("label", { for: growId, text: "Partitions of a new storage topic" }),
    el("input", { id: growId, name: "partitions", type: "number", min: "1", value: "2", required: true })),
  el("button", { type: "submit" }, `Grow ${topic.name}`),
  el("button", { type: "button", onclick: async () => {
    if (!confirm(`Move the produce pointer of ${topic.name} to its next storage topic?`)) return;
    try {
      await api("POST", `/v1/topics/${encodeURIComponent(topic.name)}/switch-produce`);
      loadTopics();
    } catch (exc) {
      error.textContent = explain(exc);
    }
  } }, `Switch produce of ${topic.name}`));
  return el("article", { class: "topic", "data-topic": topic.name },
    el("h3", { text: topic.name }),
    el("p", { text: `Produce pointer: storage topic ${topic.produce_pointer}` }),
    el("table", {}, el("caption", { text: `Storage topics of ${topic.name}` }),
      el("thead", {}, el("tr", {}, ...["Index", "Stream", "Partitions", "K", "Produced to"].map((h) => el("th", { scope: "col", text: h })))),
      el("tbody", {}, ...rows)),
    grow, error);
}

// --- sessions -----------------------------------------------------------------------------

async function lookUpSession(event) {
  event.preventDefault();
  say("session-error", "");
  const view = $("session-view");
  view.replaceChildren();
  const id = $("session-client-id").value.trim();
  try {
    const s = await api("GET", `/v1/sessions/${encodeURIComponent(id)}`);
    const expires = s.expires_at_ms ? new Date(s.expires_at_ms).toISOString() : "while connected";
    view.append(
      el("dl", {},
        el("dt", { text: "Connected" }), el("dd", { text: s.connected ? "yes" : "no" }),
        el("dt", { text: "In flight (handed out, not acked)" }), el("dd", { text: String(s.in_flight) }),
        el("dt", { text: "Session expiry" }), el("dd", { text: `${s.session_expiry_s} s (ends ${expires})` }),
        el("dt", { text: "Keepalive" }), el("dd", { text: `${s.keepalive_s} s` })),
      el("table", {}, el("caption", { text: `Subscriptions of ${s.client_id}` }),
        el("thead", {}, el("tr", {}, el("th", { scope: "col", text: "Filter" }), el("th", { scope: "col", text: "Options" }))),
        el("tbody", {}, ...s.subscriptions.map((sub) => {
          const { filter, ...rest } = sub;
          return el("tr", {}, el("td", { class: "mono", text: filter }), el("td", { class: "mono", text: JSON.stringify(rest) }));
        }))),
      el("table", { id: "session-groups" }, el("caption", { text: `Shared groups of ${s.client_id}, with the streams this session holds` }),
        el("thead", {}, el("tr", {}, ...["Group", "Members", "Lanes", "Leases held", "Whole group"].map((h) => el("th", { scope: "col", text: h })))),
        el("tbody", {}, ...(s.groups || []).map((g) => el("tr", {},
          el("td", { class: "mono", text: g.group }), el("td", { text: String(g.members) }),
          el("td", { text: String(g.lanes ?? "") }),
          el("td", { class: "mono", text: (g.leases || []).map((l) => `${l.stream} (${l.state})`).join(", ") || "none" }),
          el("td", {}, el("button", { type: "button", "aria-label": `Show the group ${g.group}`, onclick: () => showGroup(g.group) }, "Show")))))));
  } catch (exc) {
    say("session-error", explain(exc));
  }
}

// --- shared groups (admin) ---------------------------------------------------------------

const LANE_STATES = { granted: "granted", revoking: "revoking (handing over)", revoked: "free" };

// "$share/name/filter" typed into the share name field is split into its two parts
function groupOf(shareText, filterText) {
  const share = shareText.trim();
  if (share.startsWith("$share/")) {
    const rest = share.slice("$share/".length);
    const at = rest.indexOf("/");
    if (at > 0) return { share: rest.slice(0, at), filter: rest.slice(at + 1) };
  }
  return { share, filter: filterText };
}

// from another view (a session's groups): the Groups view, showing that group
function showGroup(text) {
  const { share, filter } = groupOf(text, "");
  $("group-share").value = share;
  $("group-filter").value = filter;
  show("groups");
  $("group-share").focus();
  return loadGroup(share, filter);
}

async function lookUpGroup(event) {
  event.preventDefault();
  const { share, filter } = groupOf($("group-share").value, $("group-filter").value);
  $("group-share").value = share;
  $("group-filter").value = filter;
  await loadGroup(share, filter);
}

function yesNo(value) {
  if (value === null || value === undefined) return "unknown";
  return value ? "yes" : "no";
}

function when(ms) {
  return ms ? new Date(ms).toISOString() : "";
}

async function loadGroup(share, filter) {
  say("group-error", "");
  const view = $("group-view");
  view.setAttribute("aria-busy", "true");
  try {
    const g = await api("GET", `/v1/groups/${encodeURIComponent(share)}?filter=${encodeURIComponent(filter)}`);
    const names = new Map(g.members.map((m) => [m.session_id, m.client_id]));
    const memberRows = g.members.map((m) => el("tr", { "data-client-id": m.client_id },
      el("td", { class: "mono", text: m.client_id }), el("td", { class: "mono", text: m.session_id }),
      el("td", { text: yesNo(m.connected) }), el("td", { text: yesNo(m.live) }),
      el("td", { text: String(m.lanes_held) }), el("td", { text: String(m.held_qos2) }),
      el("td", { text: when(m.joined_at_ms) }), el("td", { text: when(m.renewed_at_ms) })));
    const laneRows = g.lanes.map((l) => el("tr", { "data-stream": l.stream, "data-state": l.state },
      el("td", { class: "mono", text: l.source }), el("td", { text: String(l.lane) }),
      el("td", { text: LANE_STATES[l.state] || l.state }),
      el("td", { class: "mono holder", text: l.holder ? (l.holder_client_id || names.get(l.holder) || l.holder) : "none" }),
      el("td", { text: String(l.lease) }), el("td", { text: String(l.in_flight) }),
      el("td", { text: when(l.since_ms) })));
    const held = g.lanes.filter((l) => l.holder).length;
    view.replaceChildren(
      el("h3", { class: "mono", text: g.group }),
      el("dl", {},
        el("dt", { text: "Members" }), el("dd", { id: "group-member-count", text: String(g.members.length) }),
        el("dt", { text: "Lanes held" }), el("dd", { id: "group-held", text: `${held} of ${g.lanes.length}` }),
        el("dt", { text: "Lanes per source shard" }), el("dd", { text: String(g.lanes_per_source) }),
        el("dt", { text: "Lease timeout" }), el("dd", { text: `${g.lease_timeout_ms / 1000} s` }),
        el("dt", { text: "Leader version" }), el("dd", { text: String(g.version) }),
        el("dt", { text: "Created" }), el("dd", { text: when(g.created_at_ms) })),
      el("button", { type: "button", onclick: () => loadGroup(share, filter) }, "Refresh the group"),
      el("table", { id: "group-members" }, el("caption", { text: `Members of ${g.group}` }),
        el("thead", {}, el("tr", {}, ...["Client id", "Session", "Connected", "Live (renewed in time)", "Lanes held", "QoS 2 held", "Joined", "Last renewal"].map((h) => el("th", { scope: "col", text: h })))),
        el("tbody", {}, ...memberRows)),
      el("table", { id: "group-lanes" }, el("caption", { text: `Lanes of ${g.group} and who holds them` }),
        el("thead", {}, el("tr", {}, ...["Source shard", "Lane", "State", "Holder", "Lease", "In flight", "Since"].map((h) => el("th", { scope: "col", text: h })))),
        el("tbody", {}, ...laneRows)));
    if (!g.lanes.length) {
      view.append(el("p", { text: "No lanes yet: the router makes a source's lanes known with the first message of the group it routes from that shard." }));
    }
  } catch (exc) {
    view.replaceChildren();
    say("group-error", explain(exc));
  } finally {
    view.removeAttribute("aria-busy");
  }
}

// --- push subscriptions (admin) -----------------------------------------------------------

async function loadPushSubscriptions() {
  say("push-error", "");
  const list = $("push-list");
  try {
    const page = await api("GET", "/v1/subscriptions?limit=100");
    const rows = page.subscriptions.map((s) => el("tr", {},
      el("td", {}, el("button", { type: "button", onclick: () => loadPushDetail(s.name) }, s.name)),
      el("td", { class: "mono", text: s.filter }), el("td", { class: "mono", text: s.endpoint }),
      el("td", { text: s.state })));
    list.replaceChildren(el("table", {}, el("caption", { text: "Push subscriptions (choose one for its queues)" }),
      el("thead", {}, el("tr", {}, ...["Name", "Filter", "Endpoint", "State"].map((h) => el("th", { scope: "col", text: h })))),
      el("tbody", {}, ...rows)));
    if (!rows.length) list.append(el("p", { text: "No push subscriptions." }));
  } catch (exc) {
    list.replaceChildren();
    say("push-error", explain(exc));
  }
}

async function loadPushDetail(name) {
  say("push-error", "");
  const detail = $("push-detail");
  // a click while an earlier load is on its way: only the last one is drawn
  const load = ++state.pushDetailLoads;
  try {
    const s = await api("GET", `/v1/subscriptions/${encodeURIComponent(name)}`);
    const dlq = await api("GET", `/v1/subscriptions/${encodeURIComponent(name)}/dlq?limit=100`);
    if (load !== state.pushDetailLoads) return;
    const report = el("pre", { id: "redrive-answer", tabindex: "0", "aria-live": "polite" });
    const error = el("p", { id: "redrive-error", class: "error", role: "alert" });
    const form = el("form", { id: "redrive-form", class: "row", onsubmit: async (event) => {
      event.preventDefault();
      error.textContent = "";
      const by = event.target.elements.by.value;
      const raw = event.target.elements.value.value.trim();
      let body;
      if (by === "failed_after") body = { failed_after: /^\d+$/.test(raw) ? Number(raw) : raw };
      else body = { [by]: raw.split(/\s+/).filter(Boolean) };
      try {
        const answer = await api("POST", `/v1/subscriptions/${encodeURIComponent(name)}/dlq/redrive`, body);
        await loadPushDetail(name);
        $("redrive-answer").textContent = JSON.stringify(answer, null, 2);
      } catch (exc) {
        error.textContent = explain(exc);
      }
    } },
    el("div", {}, el("label", { for: "redrive-by", text: "Redrive by" }),
      el("select", { id: "redrive-by", name: "by" },
        el("option", { value: "ordering_keys", text: "ordering keys" }),
        el("option", { value: "message_ids", text: "message ids" }),
        el("option", { value: "failed_after", text: "failed after (ms or ISO time)" }))),
    el("div", {}, el("label", { for: "redrive-value", text: "Keys, ids (space-separated) or time" }),
      el("input", { id: "redrive-value", name: "value", autocomplete: "off", required: true })),
    el("button", { type: "submit" }, "Redrive"));
    const letterRow = (m) => el("tr", { "data-ordering-key": m.ordering_key },
      el("td", { class: "mono", text: m.id }), el("td", { class: "mono", text: m.ordering_key }),
      el("td", { class: "mono", text: m.topic }), el("td", { text: m.reason }),
      el("td", { text: String(m.attempts) }), el("td", { text: String(m.failed_at) }));
    const letters = dlq.messages.map(letterRow);
    // the DLQ is browsed a page at a time: the next page starts after the last one's "next"
    let after = dlq.next;
    const more = el("button", { type: "button", id: "dlq-more", hidden: !after, onclick: async () => {
      try {
        const page = await api("GET", `/v1/subscriptions/${encodeURIComponent(name)}/dlq?limit=100&after=${encodeURIComponent(after)}`);
        $("dlq").tBodies[0].append(...page.messages.map(letterRow));
        after = page.next;
        more.hidden = !after;
      } catch (exc) {
        error.textContent = explain(exc);
      }
    } }, "More dead letters");
    detail.replaceChildren(
      el("h3", { text: name }),
      el("dl", {},
        el("dt", { text: "Filter" }), el("dd", { class: "mono", text: s.filter }),
        el("dt", { text: "Retry depth" }), el("dd", { id: "retry-depth", text: String(s.retry_depth ?? "?") }),
        el("dt", { text: "Dead letters" }), el("dd", { id: "dlq-depth", text: String(s.dlq_depth ?? "?") }),
        el("dt", { text: "Blocked keys" }), el("dd", { class: "mono", text: (s.blocked_keys || []).join(" ") || "none" })),
      el("table", { id: "dlq" }, el("caption", { text: `Dead letters of ${name}` }),
        el("thead", {}, el("tr", {}, ...["Id", "Ordering key", "Topic", "Reason", "Attempts", "Failed at"].map((h) => el("th", { scope: "col", text: h })))),
        el("tbody", {}, ...letters)),
      more, form, error, report);
  } catch (exc) {
    say("push-error", explain(exc));
  }
}

// --- start --------------------------------------------------------------------------------

async function start() {
  try {
    const response = await fetch("config.json");
    if (response.ok) state.config = { ...state.config, ...(await response.json()) };
  } catch (_exc) {
    // no config: the page's origin serves the HTTP API, the WebSocket URL is typed in
  }
  $("ws-url").value = sessionStorage.getItem(WS_KEY) || state.config.ws_url || "";
  $("mint-form").hidden = !state.config.local_mint;
  $("signin-form").addEventListener("submit", (event) => {
    event.preventDefault();
    signIn($("token").value);
  });
  $("mint-form").addEventListener("submit", mintLocal);
  $("signout").addEventListener("click", signOut);
  for (const button of document.querySelectorAll("#views button")) {
    button.addEventListener("click", () => show(button.dataset.view));
  }
  $("connect-form").addEventListener("submit", connect);
  $("disconnect").addEventListener("click", () => closeSocket("disconnected"));
  $("subscribe-form").addEventListener("submit", subscribe);
  $("clear-messages").addEventListener("click", () => {
    $("messages").tBodies[0].replaceChildren();
    state.received = 0;
    say("message-count", "0");
  });
  $("publish-form").addEventListener("submit", publish);
  $("topics-refresh").addEventListener("click", loadTopics);
  $("session-form").addEventListener("submit", lookUpSession);
  $("group-form").addEventListener("submit", lookUpGroup);
  $("push-refresh").addEventListener("click", loadPushSubscriptions);
  const savedRange = sessionStorage.getItem(RANGE_KEY);
  if (savedRange && RANGE_WORDS[savedRange]) $(`range-${savedRange}`).checked = true;
  $("overview-form").addEventListener("submit", (event) => {
    event.preventDefault();
    loadOverview(true);
  });
  for (const radio of document.querySelectorAll('input[name="overview-range"]')) {
    radio.addEventListener("change", () => {
      sessionStorage.setItem(RANGE_KEY, overviewRange());
      loadOverview(true);
    });
  }
  $("overview-auto").addEventListener("change", () => {
    if ($("overview-auto").checked) loadOverview(false);
    else stopOverviewTimer();
  });
  // a hidden tab asks nothing; shown again, it catches up at once
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) stopOverviewTimer();
    else if (!$("overview").hidden && $("overview-auto").checked) loadOverview(false);
  });
  window.addEventListener("unhandledrejection", (event) => say("page-error", explain(event.reason)));
  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (!saved || !signIn(saved)) $("token").focus();
  document.body.dataset.ready = "true";
}

start();
