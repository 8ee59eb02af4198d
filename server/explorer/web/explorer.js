// attnserve attention explorer: the page's logic. Plain JavaScript and canvas,
// no third-party code; it talks only to its own origin's /explorer/api (see the
// README's "Attention explorer" section for the API).
//
// Safety: every string from the server or the user (labels, model names, error
// messages) reaches the page through textContent or canvas fillText, never as
// HTML. The bearer token lives in the password field only (memory), sent as
// "Authorization: Bearer" when non-empty.
//
// Observable state (for people and for tests): body[data-state] is "busy"
// while a request runs, then "ready" or "error"; body[data-requests] counts
// finished actions; each view's canvas carries data-rendered, a count of its
// renders; #hover-readout carries data-query, data-key and data-weight of the
// cell under the pointer. Weights are displayed to 4 significant digits.
"use strict";

(() => {
  const WEIGHT_DIGITS = 4;  // significant digits of every weight shown
  const DEFAULT_GRID = 256;  // pooled map size asked for (at most limits.max_grid)
  const LINES_TOP_KEYS = 12;  // head view: keys drawn per head for long sequences
  const LINES_ALL_KEYS_UP_TO = 40;  // head view: every key drawn up to this length

  const $ = (id) => document.getElementById(id);

  const state = {
    models: [],
    limits: null,
    base: null,  // the request's fixed part: model (or layer), inputs, causal, key_mask
    sourceKey: "",  // which model or ad-hoc layer state.base runs
    uploadName: "",  // the uploaded file's name, for error messages
    inputsBytes: null,  // the uploaded .npy's bytes (export)
    response: null,  // the last /attend answer
    S: 0,
    H: 0,
    grid: null,  // {pool, rows, cols, data: Float32Array [H, rows, cols]}
    vmax: 1,
    headMask: [],  // 1 or 0 per head
    labels: null,  // array of strings or null
    largeHead: 0,
    region: null,  // {head, q0, q1, k0, k1, data: Float32Array}
    row: null,  // {query, data: Float32Array [H, S]}
    largeGeometry: null,
    largeImage: null,
    drag: null,
    sort: {key: "head", dir: 1},
    downloadUrl: null,
    session: null,  // the last /session answer: {..., data: Float32Array [H, cols], vmax}
    sessionGeometry: null,
  };

  // --- Small helpers ---------------------------------------------------------

  class UserError extends Error {}
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function formatWeight(v) {
    if (v < 0) return "masked";
    return v.toPrecision(WEIGHT_DIGITS);
  }

  function formatCount(n) {
    return n.toLocaleString("en-US");
  }

  function formatBytes(n) {
    if (n >= 1 << 20) return (n / (1 << 20)).toFixed(1) + " MiB";
    if (n >= 1 << 10) return (n / (1 << 10)).toFixed(1) + " KiB";
    return n + " bytes";
  }

  function label(i) {
    const l = state.labels;
    return l && i < l.length && l[i] !== "" ? l[i] : String(i);
  }

  function describePosition(i) {
    return state.labels && i < state.labels.length ? `${i} "${state.labels[i]}"` : String(i);
  }

  function shorten(text, n) {
    return text.length > n ? text.slice(0, n - 1) + "\u2026" : text;
  }

  function bump(element, attribute) {
    element.dataset[attribute] = String(Number(element.dataset[attribute] || "0") + 1);
  }

  const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

  function bytesToBase64(bytes) {
    let s = "";
    const chunk = 0x8000;
    for (let i = 0; i < bytes.length; i += chunk) {
      s += String.fromCharCode.apply(null, bytes.subarray(i, i + chunk));
    }
    return btoa(s);
  }

  function base64ToBytes(b64) {
    const bin = atob(b64);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return bytes;
  }

  // f32 base64 (little-endian float32) -> Float32Array.
  function base64ToF32(b64, what) {
    const bytes = base64ToBytes(b64);
    if (bytes.length % 4 !== 0) throw new Error(`${what}: ${bytes.length} bytes is not a whole number of float32`);
    if (LITTLE_ENDIAN) return new Float32Array(bytes.buffer);
    const view = new DataView(bytes.buffer);
    const out = new Float32Array(bytes.length / 4);
    for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(4 * i, true);
    return out;
  }

  // The shape in a .npy header, or null when the bytes do not start like one.
  function npyShape(bytes) {
    const magic = [0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59];  // \x93NUMPY
    if (bytes.length < 12 || magic.some((b, i) => bytes[i] !== b)) return null;
    const major = bytes[6];
    let length;
    let offset;
    if (major === 1) {
      length = bytes[8] | (bytes[9] << 8);
      offset = 10;
    } else {
      length = (bytes[8] | (bytes[9] << 8) | (bytes[10] << 16)) + bytes[11] * 16777216;
      offset = 12;
    }
    if (offset + length > bytes.length || length > 65536) return null;
    const header = new TextDecoder("latin1").decode(bytes.subarray(offset, offset + length));
    const m = /'shape'\s*:\s*\(([^)]*)\)/.exec(header);
    if (!m) return null;
    const dims = m[1].split(",").map((s) => s.trim()).filter((s) => s !== "").map(Number);
    return dims.every((d) => Number.isInteger(d) && d >= 0) ? dims : null;
  }

  // A .npy (version 1.0) of float32 values, little-endian ("<f4"), C order.
  function npyBytes(values, shape) {
    const dims = shape.join(", ") + (shape.length === 1 ? "," : "");
    let header = `{'descr': '<f4', 'fortran_order': False, 'shape': (${dims}), }`;
    const unpadded = 10 + header.length + 1;  // magic, version, length, header, "\n"
    header += " ".repeat((64 - (unpadded % 64)) % 64) + "\n";
    const out = new Uint8Array(10 + header.length + 4 * values.length);
    out.set([0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 1, 0, header.length & 0xff, header.length >> 8]);
    for (let i = 0; i < header.length; i++) out[10 + i] = header.charCodeAt(i);
    const view = new DataView(out.buffer, 10 + header.length);
    for (let i = 0; i < values.length; i++) view.setFloat32(4 * i, values[i], true);
    return out;
  }

  // --- Status, errors, busy --------------------------------------------------

  function showError(message) {
    const e = $("error");
    e.textContent = message;
    e.hidden = !message;
  }

  function showNotice(message) {
    const n = $("notice");
    n.textContent = message;
    n.hidden = !message;
  }

  function describeError(err) {
    if (err instanceof UserError) return err.message;
    if (err instanceof ApiError) {
      const prefix = state.uploadName && /^inputs/.test(err.message) ? `Upload "${state.uploadName}": ` : "";
      if (err.status === 401) return `The server asks for a bearer token (401): ${err.message}`;
      if (err.status === 403) return `The server refused the page (403): ${err.message}`;
      return `${prefix}The server refused the request (HTTP ${err.status}): ${err.message}`;
    }
    if (err instanceof TypeError) return `Could not reach the server: ${err.message}`;
    return `Error: ${err && err.message ? err.message : String(err)}`;
  }

  let busyDepth = 0;

  // Runs fn with the busy indication shown; errors end up in #error.
  async function busy(text, fn) {
    busyDepth++;
    $("busy-text").textContent = text;
    $("busy").hidden = false;
    $("run").disabled = true;
    document.body.dataset.state = "busy";
    showError("");
    let ok = true;
    try {
      await fn();
    } catch (err) {
      ok = false;
      showError(describeError(err));
    } finally {
      busyDepth--;
      if (busyDepth === 0) {
        $("busy").hidden = true;
        $("run").disabled = false;
      }
      document.body.dataset.state = ok ? "ready" : "error";
      bump(document.body, "requests");
    }
  }

  async function api(path, body) {
    const headers = {};
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const token = $("token").value;
    if (token) headers["Authorization"] = "Bearer " + token;
    const response = await fetch(path, {
      method: body === undefined ? "GET" : "POST",
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
      credentials: "same-origin",
      referrerPolicy: "no-referrer",
    });
    const text = await response.text();
    let json = null;
    try {
      json = JSON.parse(text);
    } catch (e) {
      json = null;
    }
    if (!response.ok) {
      const message = json && typeof json.error === "string" ? json.error : `${response.status} ${response.statusText}`;
      throw new ApiError(response.status, message);
    }
    if (json === null || typeof json !== "object") throw new ApiError(response.status, "the answer is not JSON");
    return json;
  }

  // --- Models ----------------------------------------------------------------

  function currentModel() {
    return state.models.find((m) => m.name === $("model").value) || null;
  }

  // The model choice's last option is an ad-hoc layer (data-adhoc="1"):
  // a head configuration of the user's, weights drawn from a seed.
  function adHocChosen() {
    const option = $("model").selectedOptions[0];
    return Boolean(option && option.dataset.adhoc === "1");
  }

  function layerLimits() {
    return state.limits && state.limits.layer ? state.limits.layer : {};
  }

  function showModelInfo() {
    const adhoc = adHocChosen();
    $("layer-fields").hidden = !adhoc;
    if (adhoc) {
      $("model-info").textContent = "An attention layer of your own head configuration, its weights drawn from " +
                                    "a seed (the server's seeded generator).";
      showLayerInfo();
      return;
    }
    const m = currentModel();
    $("model-info").textContent = m
      ? `${m.num_heads} heads (${m.num_kv_heads} key/value heads), head_dim ${m.head_dim}, d_model ${m.d_model}, ` +
        `up to ${formatCount(m.max_seq_len)} tokens. ${m.description || ""}`
      : "";
  }

  // The ad-hoc layer's bounds (limits.layer) on its fields, and its weights'
  // size against the server's limit.
  function showLayerInfo() {
    const l = layerLimits();
    const bounds = {"layer-d-model": l.max_d_model, "layer-heads": l.max_heads, "layer-kv-heads": l.max_heads,
                    "layer-head-dim": l.max_head_dim};
    for (const [id, max] of Object.entries(bounds)) if (Number.isInteger(max)) $(id).max = String(max);
    $("layer-theta").disabled = !$("layer-rope").checked;
    const value = (id) => Number($(id).value.trim() === "" ? NaN : $(id).value);
    const d = value("layer-d-model");
    const h = value("layer-heads");
    const kv = $("layer-kv-heads").value.trim() === "" ? h : value("layer-kv-heads");
    const hd = $("layer-head-dim").value.trim() === "" ? d / h : value("layer-head-dim");
    const parts = [];
    if ([d, h, kv, hd].every((v) => Number.isInteger(v) && v > 0)) {
      // As FP32: w_q, w_k, w_v, w_o and their biases.
      const q = h * hd;
      const kvw = kv * hd;
      const bytes = 4 * (2 * d * q + 2 * d * kvw + q + 2 * kvw + d);
      const max = l.max_weight_bytes;
      parts.push(`weights ${formatBytes(bytes)}` +
                 (Number.isFinite(max) ? ` of the server's ${formatBytes(max)} (limits.layer.max_weight_bytes)` : ""));
    }
    if (Number.isFinite(l.max_seq_len)) parts.push(`up to ${formatCount(l.max_seq_len)} tokens`);
    $("layer-info").textContent = parts.join("; ");
  }

  // The ad-hoc layer's fields as the API's "layer"; each refusal names the
  // field. What the sizes must satisfy together (KV heads divide heads, ...)
  // the server checks.
  function readLayer() {
    const l = layerLimits();
    const bound = (v) => (Number.isInteger(v) ? v : Number.MAX_SAFE_INTEGER);
    const layer = {
      d_model: readInteger("layer-d-model", "layer.d_model", 1, bound(l.max_d_model)),
      num_heads: readInteger("layer-heads", "layer.num_heads", 1, bound(l.max_heads)),
    };
    layer.num_kv_heads = $("layer-kv-heads").value.trim() === ""
      ? layer.num_heads : readInteger("layer-kv-heads", "layer.num_kv_heads", 1, bound(l.max_heads));
    if ($("layer-head-dim").value.trim() !== "") {
      layer.head_dim = readInteger("layer-head-dim", "layer.head_dim", 1, bound(l.max_head_dim));
    }
    layer.seed = readInteger("layer-seed", "layer.seed", 0, Number.MAX_SAFE_INTEGER);
    if ($("layer-rope").checked) {
      const text = $("layer-theta").value.trim();
      const theta = Number(text);
      if (text === "" || !Number.isFinite(theta) || !(theta > 1)) {
        throw new UserError(`layer.rotary.theta: "${text}" is not a number greater than 1`);
      }
      layer.rotary = {theta};
    }
    return layer;
  }

  // What a request runs: a loaded model or the ad-hoc layer, with the
  // figures the page needs before the answer.
  function currentSource() {
    if (adHocChosen()) {
      const layer = readLayer();
      const maxSeq = layerLimits().max_seq_len;
      return {layer, d_model: layer.d_model, num_heads: layer.num_heads,
              max_seq_len: Number.isInteger(maxSeq) ? maxSeq : Number.MAX_SAFE_INTEGER,
              key: "layer:" + JSON.stringify(layer)};
    }
    const model = currentModel();
    if (!model) throw new UserError("model: no model chosen (is the server reachable? try Reload models)");
    return {model: model.name, d_model: model.d_model, num_heads: model.num_heads, max_seq_len: model.max_seq_len,
            key: "model:" + model.name};
  }

  // What ran, from the answer's echo of an ad-hoc layer.
  function describeLayer(l) {
    const rope = l.rotary ? `RoPE (theta ${l.rotary.theta}, ${l.rotary.rotary_dim} dims)` : "no RoPE";
    return `Ran the ad-hoc layer: d_model ${l.d_model}, ${l.num_heads} heads (${l.num_kv_heads} key/value heads), ` +
           `head_dim ${l.head_dim}, ${rope}, weight seed ${l.seed}.`;
  }

  async function loadModels() {
    await busy("Loading models", async () => {
      const answer = await api("api/models");
      state.models = Array.isArray(answer.models) ? answer.models : [];
      state.limits = answer.limits || null;
      const select = $("model");
      const previous = select.value;
      const previousAdHoc = adHocChosen();
      select.textContent = "";
      for (const m of state.models) {
        const option = document.createElement("option");
        option.value = m.name;
        option.textContent = `${m.name} (${m.num_heads} heads, d_model ${m.d_model})`;
        select.appendChild(option);
      }
      if (state.limits && state.limits.layer) {
        const option = document.createElement("option");
        option.value = "";
        option.dataset.adhoc = "1";
        option.id = "model-adhoc";
        option.textContent = "ad-hoc layer (your head configuration)";
        select.appendChild(option);
      }
      if (previousAdHoc && select.lastElementChild && select.lastElementChild.dataset.adhoc === "1") {
        select.selectedIndex = select.options.length - 1;
      } else if (state.models.some((m) => m.name === previous)) {
        select.value = previous;
      }
      showModelInfo();
      if (select.options.length === 0) throw new UserError("The server has no model loaded.");
    });
  }

  // --- Building the request --------------------------------------------------

  function readInteger(id, what, min, max) {
    const text = $(id).value.trim();
    const v = Number(text);
    if (text === "" || !Number.isInteger(v)) throw new UserError(`${what}: "${text}" is not a whole number`);
    if (v < min || v > max) throw new UserError(`${what}: ${v} is outside [${min}, ${max}]`);
    return v;
  }

  function parseKeyMask(text, S) {
    const mask = new Array(S).fill(1);
    for (const part of text.split(/[\s,;]+/).filter((p) => p !== "")) {
      const m = /^(\d+)(?:-(\d+))?$/.exec(part);
      if (!m) throw new UserError(`key mask: "${part}" is not a position or a range like 5-9`);
      const a = Number(m[1]);
      const b = m[2] === undefined ? a : Number(m[2]);
      if (b < a || b >= S) throw new UserError(`key mask: "${part}" is outside the positions 0-${S - 1}`);
      for (let i = a; i <= b; i++) mask[i] = 0;
    }
    return mask;
  }

  function parseLabels() {
    const text = $("labels").value.replace(/\r/g, "");
    if (text.trim() === "") return null;
    const lines = text.split("\n");
    if (lines.length > 0 && lines[lines.length - 1] === "") lines.pop();
    return lines;
  }

  async function buildBase() {
    const model = currentSource();
    let inputs;
    let S = null;
    state.uploadName = "";
    state.inputsBytes = null;
    if ($("source-random").checked) {
      const seed = readInteger("seed", "seed", 0, Number.MAX_SAFE_INTEGER);
      S = readInteger("seq-len", "seq_len", 1, model.max_seq_len);
      inputs = {random: {seed, seq_len: S}};
    } else {
      const file = $("npy-file").files[0];
      if (!file) throw new UserError("inputs: choose a .npy file to upload (or seeded random inputs)");
      const maxBody = state.limits ? state.limits.max_body_bytes : Infinity;
      // base64 grows the file by 4/3; the rest of the request is small.
      if (Math.ceil(file.size / 3) * 4 + 4096 > maxBody) {
        throw new UserError(`inputs: "${file.name}" is ${formatBytes(file.size)}; sent as base64 it is over the ` +
                            `server's limit of ${formatBytes(maxBody)} per request (limits.max_body_bytes)`);
      }
      const bytes = new Uint8Array(await file.arrayBuffer());
      state.uploadName = file.name;
      state.inputsBytes = bytes;
      const shape = npyShape(bytes);
      if (shape && (shape.length === 2 || shape.length === 3)) S = shape[shape.length - 2];
      inputs = {npy: bytesToBase64(bytes)};
    }
    const base = model.layer ? {layer: model.layer} : {model: model.model};
    Object.assign(base, {inputs, causal: $("causal").checked});
    const maskText = $("key-mask").value.trim();
    if (maskText !== "") {
      if (S === null) throw new UserError("key mask: the upload's length is unknown (its .npy header has no shape)");
      base.key_mask = parseKeyMask(maskText, S);
    }
    return base;
  }

  function gridSize() {
    const max = state.limits && state.limits.max_grid ? state.limits.max_grid : DEFAULT_GRID;
    return Math.min(DEFAULT_GRID, max);
  }

  function requestBody(extra) {
    const body = Object.assign({}, state.base, {grid: gridSize()}, extra || {});
    if (state.headMask.some((g) => g === 0)) body.head_mask = state.headMask.slice();
    return body;
  }

  function maxRegionCells() {
    return state.limits && state.limits.max_region_cells ? state.limits.max_region_cells : Infinity;
  }

  // --- Running ---------------------------------------------------------------

  async function run() {
    await busy("Computing the maps", async () => {
      showNotice("");
      const base = await buildBase();
      const model = currentSource();
      if (state.headMask.length !== model.num_heads || state.sourceKey !== model.key) {
        state.headMask = new Array(model.num_heads).fill(1);
      }
      state.base = base;
      state.sourceKey = model.key;
      state.labels = parseLabels();
      state.largeHead = Math.min(state.largeHead, model.num_heads - 1);
      await attend();
    });
  }

  // The main request (grid + statistics + output), then the head view's row.
  async function attend() {
    const answer = await api("api/attend", requestBody());
    state.response = answer;
    if (answer.layer) $("model-info").textContent = describeLayer(answer.layer);
    state.S = answer.seq_len;
    state.H = answer.num_heads;
    if (!answer.grid) throw new Error("the answer has no grid");
    const g = answer.grid;
    state.grid = {pool: g.pool, rows: g.rows, cols: g.cols, data: base64ToF32(g.data, "grid.data")};
    if (state.grid.data.length !== state.H * g.rows * g.cols) {
      throw new Error(`grid.data has ${state.grid.data.length} values, not ${state.H} x ${g.rows} x ${g.cols}`);
    }
    let vmax = 0;
    for (const v of state.grid.data) if (v > vmax) vmax = v;
    state.vmax = vmax > 0 ? vmax : 1;
    state.region = null;
    state.row = null;
    if (state.headMask.length !== state.H) state.headMask = new Array(state.H).fill(1);
    if (state.labels && state.labels.length !== state.S) {
      showNotice(`labels: ${state.labels.length} given for ${state.S} positions; ` +
                 "positions without a label show their number.");
    }
    $("query").max = String(state.S - 1);
    if (Number($("query").value) > state.S - 1) $("query").value = String(state.S - 1);
    renderToggles();
    renderOutputChange();
    renderLegend();
    renderGrid();
    renderLarge();
    renderStats();
    await fetchRow();
  }

  async function fetchRow() {
    const q = Number($("query").value);
    if (!Number.isInteger(q) || q < 0 || q >= state.S) {
      throw new UserError(`query position: ${$("query").value} is outside the positions 0-${state.S - 1}`);
    }
    $("query-label").textContent = state.labels ? `"${label(q)}"` : "";
    const cells = state.H * state.S;
    if (cells > maxRegionCells()) {
      showNotice(`The head view needs ${formatCount(cells)} cells (${state.H} heads x ${state.S} keys), over the ` +
                 `server's limit of ${formatCount(maxRegionCells())} per answer (limits.max_region_cells).`);
      return;
    }
    // grid 0: only this row is computed, not the pooled maps again.
    const answer = await api("api/attend", requestBody({query_row: q, grid: 0}));
    if (!answer.row) throw new Error("the answer has no row");
    state.row = {query: answer.row.query, data: base64ToF32(answer.row.data, "row.data")};
    renderLines();
  }

  async function fetchRegion(q0, q1, k0, k1) {
    const cells = (q1 - q0) * (k1 - k0);
    if (cells > maxRegionCells()) {
      showNotice(`The region of queries ${q0}-${q1 - 1} x keys ${k0}-${k1 - 1} has ${formatCount(cells)} cells, over ` +
                 `the server's limit of ${formatCount(maxRegionCells())} per answer (limits.max_region_cells): ` +
                 "drag a smaller region.");
      bump($("large-canvas"), "refused");
      return;
    }
    await busy("Fetching the region at full resolution", async () => {
      showNotice("");
      const head = state.largeHead;
      const answer = await api("api/attend", requestBody({region: {head, q0, q1, k0, k1}, grid: 0}));
      if (!answer.region) throw new Error("the answer has no region");
      const r = answer.region;
      state.region = {head, q0: r.q0, q1: r.q1, k0: r.k0, k1: r.k1, data: base64ToF32(r.data, "region.data")};
      renderLarge();
    });
  }

  // --- Colours ---------------------------------------------------------------

  // Dark blue (0) through teal and green to yellow (the largest weight).
  const RAMP = [[16, 18, 64], [38, 72, 152], [24, 148, 160], [132, 200, 84], [250, 232, 64]];
  const LUT = (() => {
    const lut = new Uint8ClampedArray(256 * 3);
    for (let i = 0; i < 256; i++) {
      const t = (i / 255) * (RAMP.length - 1);
      const a = Math.min(Math.floor(t), RAMP.length - 2);
      const f = t - a;
      for (let c = 0; c < 3; c++) lut[3 * i + c] = RAMP[a][c] + f * (RAMP[a + 1][c] - RAMP[a][c]);
    }
    return lut;
  })();

  function scaled(v, vmax) {
    const t = Math.min(1, v / vmax);
    return $("scale").value === "sqrt" ? Math.sqrt(t) : t;
  }

  // Paints map cells [rows, cols] (values at data[offset...]) into a w x h
  // pixel box at (x0, y0), on the colour scale whose top is vmax; masked
  // cells (-1) are hatched grey.
  function paintMap(ctx, x0, y0, w, h, data, offset, rows, cols, vmax = state.vmax) {
    const image = ctx.createImageData(w, h);
    const px = image.data;
    const colOf = new Int32Array(w);
    for (let x = 0; x < w; x++) colOf[x] = Math.min(cols - 1, Math.floor((x * cols) / w));
    for (let y = 0; y < h; y++) {
      const rowStart = offset + Math.min(rows - 1, Math.floor((y * rows) / h)) * cols;
      for (let x = 0; x < w; x++) {
        const v = data[rowStart + colOf[x]];
        const p = 4 * (y * w + x);
        if (v < 0) {
          const g = ((x + y) & 4) === 0 ? 214 : 168;
          px[p] = g;
          px[p + 1] = g;
          px[p + 2] = g;
        } else {
          const i = 3 * Math.round(255 * scaled(v, vmax));
          px[p] = LUT[i];
          px[p + 1] = LUT[i + 1];
          px[p + 2] = LUT[i + 2];
        }
        px[p + 3] = 255;
      }
    }
    ctx.putImageData(image, x0, y0);
  }

  function renderLegend() {
    const canvas = $("legend");
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    const w = 200;
    const bar = ctx.createImageData(w, 14);
    for (let x = 0; x < w; x++) {
      const t = x / (w - 1);
      const i = 3 * Math.round(255 * ($("scale").value === "sqrt" ? Math.sqrt(t) : t));
      for (let y = 0; y < 14; y++) {
        const p = 4 * (y * w + x);
        bar.data.set([LUT[i], LUT[i + 1], LUT[i + 2], 255], p);
      }
    }
    ctx.putImageData(bar, 8, 4);
    ctx.fillStyle = "#333";
    ctx.font = "11px sans-serif";
    ctx.textAlign = "left";
    ctx.fillText("0", 8, 32);
    ctx.textAlign = "right";
    ctx.fillText(formatWeight(state.vmax), 8 + w, 32);
    ctx.textAlign = "center";
    ctx.fillText($("scale").value === "sqrt" ? "weight (sqrt scale)" : "weight", 8 + w / 2, 32);
    const hatch = ctx.createImageData(16, 14);
    for (let y = 0; y < 14; y++) {
      for (let x = 0; x < 16; x++) {
        const g = ((x + y) & 4) === 0 ? 214 : 168;
        hatch.data.set([g, g, g, 255], 4 * (y * 16 + x));
      }
    }
    ctx.putImageData(hatch, 222, 4);
    ctx.textAlign = "left";
    ctx.fillText("masked", 242, 15);
  }

  // --- (a) the grid of heads -------------------------------------------------

  const TILE = 110;
  const TILE_GAP = 14;
  const TILE_TITLE = 18;

  function gridLayout() {
    const perRow = Math.min(state.H, state.H <= 16 ? 4 : 8);
    return {perRow, rows: Math.ceil(state.H / perRow)};
  }

  function renderGrid() {
    const canvas = $("grid-canvas");
    const {perRow, rows} = gridLayout();
    canvas.width = perRow * (TILE + TILE_GAP);
    canvas.height = rows * (TILE + TILE_GAP + TILE_TITLE);
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    const g = state.grid;
    ctx.font = "12px sans-serif";
    ctx.textAlign = "left";
    for (let h = 0; h < state.H; h++) {
      const x = (h % perRow) * (TILE + TILE_GAP);
      const y = Math.floor(h / perRow) * (TILE + TILE_GAP + TILE_TITLE);
      ctx.fillStyle = state.headMask[h] === 0 ? "#999" : "#222";
      ctx.fillText(`head ${h}${state.headMask[h] === 0 ? " (removed)" : ""}`, x, y + 13);
      paintMap(ctx, x, y + TILE_TITLE, TILE, TILE, g.data, h * g.rows * g.cols, g.rows, g.cols);
      if (h === state.largeHead) {
        ctx.strokeStyle = "#e0301e";
        ctx.lineWidth = 2;
        ctx.strokeRect(x + 1, y + TILE_TITLE + 1, TILE - 2, TILE - 2);
      }
    }
    // The layout, for tests and tools: tile h is at column h % perRow, row h / perRow.
    Object.assign(canvas.dataset, {perRow: String(perRow), tile: String(TILE), tileGap: String(TILE_GAP),
                                   tileTitle: String(TILE_TITLE), pool: String(g.pool)});
    $("grid-caption").textContent = g.pool > 1
      ? `S = ${state.S}, pooled ${g.pool} x ${g.pool} (each cell the maximum weight of its block); click a head`
      : `S = ${state.S}, full resolution; click a head`;
    bump(canvas, "rendered");
  }

  function onGridClick(event) {
    if (!state.grid) return;
    const rect = event.target.getBoundingClientRect();
    const x = event.clientX - rect.left;
    const y = event.clientY - rect.top;
    const {perRow} = gridLayout();
    const col = Math.floor(x / (TILE + TILE_GAP));
    const row = Math.floor(y / (TILE + TILE_GAP + TILE_TITLE));
    const h = row * perRow + col;
    if (col >= perRow || h >= state.H) return;
    state.largeHead = h;
    state.region = null;
    renderGrid();
    renderLarge();
  }

  // --- (b) one head large ----------------------------------------------------

  const MARGIN_LEFT = 100;
  const MARGIN_TOP = 100;
  const PLOT = 550;

  // What the large view shows: the pooled (or full) map of the head, or a
  // region at full resolution. Cells [rows, cols]; cell (i, j) covers queries
  // [q0 + i*step, ...) x keys [k0 + j*step, ...).
  function largeSource() {
    if (state.region && state.region.head === state.largeHead) {
      const r = state.region;
      return {rows: r.q1 - r.q0, cols: r.k1 - r.k0, data: r.data, offset: 0, step: 1, q0: r.q0, k0: r.k0,
              shape: [r.q1 - r.q0, r.k1 - r.k0], exact: true};
    }
    const g = state.grid;
    return {rows: g.rows, cols: g.cols, data: g.data, offset: state.largeHead * g.rows * g.cols, step: g.pool,
            q0: 0, k0: 0, shape: [g.rows, g.cols], exact: g.pool === 1};
  }

  function renderLarge() {
    const canvas = $("large-canvas");
    const ctx = canvas.getContext("2d", {willReadFrequently: true});
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    const src = largeSource();
    // Square cells of a whole number of pixels when they fit, else PLOT px.
    const cell = Math.max(src.rows, src.cols) <= PLOT ? Math.floor(PLOT / Math.max(src.rows, src.cols)) : 0;
    const w = cell ? cell * src.cols : PLOT;
    const h = cell ? cell * src.rows : PLOT;
    paintMap(ctx, MARGIN_LEFT, MARGIN_TOP, w, h, src.data, src.offset, src.rows, src.cols);
    state.largeGeometry = {x0: MARGIN_LEFT, y0: MARGIN_TOP, w, h, src};
    // Where the cells are, for tests and tools (canvas pixels).
    Object.assign(canvas.dataset, {plotX: String(MARGIN_LEFT), plotY: String(MARGIN_TOP), plotW: String(w),
                                   plotH: String(h), rows: String(src.rows), cols: String(src.cols),
                                   q0: String(src.q0), k0: String(src.k0), step: String(src.step)});
    drawAxes(ctx, src, w, h);
    state.largeImage = ctx.getImageData(0, 0, canvas.width, canvas.height);
    // What the pointer showed belongs to the map drawn before.
    const readout = $("hover-readout");
    readout.textContent = "Hover over the map.";
    for (const key of ["head", "query", "key", "pool", "weight"]) readout.dataset[key] = "";
    $("large-head").textContent = String(state.largeHead);
    const removed = state.headMask[state.largeHead] === 0 ? " (removed by the head mask)" : "";
    $("large-caption").textContent = src.exact
      ? (state.region && state.region.head === state.largeHead
        ? `queries ${src.q0}-${src.q0 + src.rows - 1} x keys ${src.k0}-${src.k0 + src.cols - 1}, full resolution${removed}`
        : `full resolution${removed}`)
      : `pooled ${src.step} x ${src.step} (maximum of each block)${removed}; drag to see a region at full resolution`;
    bump(canvas, "rendered");
  }

  function drawAxes(ctx, src, w, h) {
    ctx.fillStyle = "#333";
    ctx.font = "11px sans-serif";
    const S = state.S;
    const rowsPx = h / src.rows;
    const colsPx = w / src.cols;
    const labelled = src.exact && Math.min(rowsPx, colsPx) >= 12;
    const tick = (n, px) => Math.max(1, Math.ceil(n / Math.max(1, Math.floor(px / 40))));
    // Queries down the left side.
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const qStep = labelled ? 1 : tick(src.rows, h);
    for (let i = 0; i < src.rows; i += qStep) {
      const first = src.q0 + i * src.step;
      const text = src.step === 1 ? shorten(label(first), 14) : `${first}-${Math.min(S, first + src.step) - 1}`;
      ctx.fillText(text, MARGIN_LEFT - 4, MARGIN_TOP + (i + 0.5) * rowsPx);
    }
    // Keys along the top, slanted.
    const kStep = labelled ? 1 : tick(src.cols, w);
    ctx.textAlign = "left";
    for (let j = 0; j < src.cols; j += kStep) {
      const first = src.k0 + j * src.step;
      const text = src.step === 1 ? shorten(label(first), 14) : `${first}-${Math.min(S, first + src.step) - 1}`;
      ctx.save();
      ctx.translate(MARGIN_LEFT + (j + 0.5) * colsPx, MARGIN_TOP - 4);
      ctx.rotate(-Math.PI / 3);
      ctx.fillText(text, 0, 0);
      ctx.restore();
    }
    ctx.textBaseline = "alphabetic";
    ctx.textAlign = "left";
    ctx.fillText("keys \u2192", 4, 14);
    ctx.fillText("queries \u2193", 4, 30);
  }

  // The cell under canvas pixel (x, y) of the large view, or null.
  function largeCellAt(x, y) {
    const g = state.largeGeometry;
    if (!g || x < g.x0 || y < g.y0 || x >= g.x0 + g.w || y >= g.y0 + g.h) return null;
    const i = Math.min(g.src.rows - 1, Math.floor(((y - g.y0) * g.src.rows) / g.h));
    const j = Math.min(g.src.cols - 1, Math.floor(((x - g.x0) * g.src.cols) / g.w));
    return {i, j};
  }

  function canvasPoint(event) {
    const rect = event.target.getBoundingClientRect();
    const canvas = event.target;
    return {x: ((event.clientX - rect.left) * canvas.width) / rect.width,
            y: ((event.clientY - rect.top) * canvas.height) / rect.height};
  }

  function onLargeMove(event) {
    if (!state.largeGeometry) return;
    const p = canvasPoint(event);
    if (state.drag) {
      drawDrag(p);
      return;
    }
    const c = largeCellAt(p.x, p.y);
    const readout = $("hover-readout");
    if (!c) return;
    const src = state.largeGeometry.src;
    const v = src.data[src.offset + c.i * src.cols + c.j];
    const q = src.q0 + c.i * src.step;
    const k = src.k0 + c.j * src.step;
    const weight = formatWeight(v);
    if (src.step === 1) {
      readout.textContent = `head ${state.largeHead} \u00b7 query ${describePosition(q)} \u00b7 ` +
                            `key ${describePosition(k)} \u00b7 weight ${weight}`;
    } else {
      const q1 = Math.min(state.S, q + src.step) - 1;
      const k1 = Math.min(state.S, k + src.step) - 1;
      readout.textContent = `head ${state.largeHead} \u00b7 queries ${q}-${q1} \u00b7 keys ${k}-${k1} \u00b7 ` +
                            `max weight ${weight}`;
    }
    readout.dataset.head = String(state.largeHead);
    readout.dataset.query = String(q);
    readout.dataset.key = String(k);
    readout.dataset.pool = String(src.step);
    readout.dataset.weight = weight;
  }

  function onLargeDown(event) {
    if (!state.largeGeometry) return;
    const p = canvasPoint(event);
    const c = largeCellAt(p.x, p.y);
    if (!c) return;
    state.drag = {start: p, startCell: c};
    event.preventDefault();
  }

  function drawDrag(p) {
    const ctx = $("large-canvas").getContext("2d", {willReadFrequently: true});
    ctx.putImageData(state.largeImage, 0, 0);
    const s = state.drag.start;
    ctx.strokeStyle = "#e0301e";
    ctx.lineWidth = 2;
    ctx.strokeRect(Math.min(s.x, p.x), Math.min(s.y, p.y), Math.abs(p.x - s.x), Math.abs(p.y - s.y));
  }

  function onLargeUp(event) {
    if (!state.drag) return;
    const drag = state.drag;
    state.drag = null;
    $("large-canvas").getContext("2d", {willReadFrequently: true}).putImageData(state.largeImage, 0, 0);
    const p = canvasPoint(event);
    if (Math.abs(p.x - drag.start.x) < 4 && Math.abs(p.y - drag.start.y) < 4) return;  // a click
    const g = state.largeGeometry;
    const clampX = Math.max(g.x0, Math.min(g.x0 + g.w - 1, p.x));
    const clampY = Math.max(g.y0, Math.min(g.y0 + g.h - 1, p.y));
    const end = largeCellAt(clampX, clampY);
    const a = drag.startCell;
    const src = g.src;
    const S = state.S;
    const q0 = src.q0 + Math.min(a.i, end.i) * src.step;
    const q1 = Math.min(S, src.q0 + (Math.max(a.i, end.i) + 1) * src.step);
    const k0 = src.k0 + Math.min(a.j, end.j) * src.step;
    const k1 = Math.min(S, src.k0 + (Math.max(a.j, end.j) + 1) * src.step);
    fetchRegion(q0, q1, k0, k1);
  }

  // --- (c) the head view -----------------------------------------------------

  function headColour(h, alpha) {
    return `hsla(${Math.round((h * 360) / Math.max(1, state.H))}, 70%, 42%, ${alpha})`;
  }

  function renderLines() {
    const canvas = $("lines-canvas");
    const ctx = canvas.getContext("2d");
    const S = state.S;
    const H = state.H;
    const row = state.row;
    const perRow = Math.min(H, 6);
    const panelW = 160;
    const panelH = S <= LINES_ALL_KEYS_UP_TO ? Math.max(160, 14 * S) : 340;
    canvas.width = perRow * panelW;
    canvas.height = Math.ceil(H / perRow) * (panelH + 36);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    const q = row.query;
    const yOf = (t, top) => top + 24 + ((t + 0.5) * (panelH - 8)) / S;
    ctx.font = "10px sans-serif";
    for (let h = 0; h < H; h++) {
      const x = (h % perRow) * panelW;
      const top = Math.floor(h / perRow) * (panelH + 36);
      const weights = row.data.subarray(h * S, (h + 1) * S);
      const xl = x + 52;
      const xr = x + panelW - 52;
      ctx.fillStyle = state.headMask[h] === 0 ? "#999" : headColour(h, 1);
      ctx.font = "12px sans-serif";
      ctx.textAlign = "left";
      ctx.fillText(`head ${h}${state.headMask[h] === 0 ? " (removed)" : ""}`, x + 4, top + 14);
      ctx.font = "10px sans-serif";
      let keys;
      if (S <= LINES_ALL_KEYS_UP_TO) {
        keys = [];
        for (let k = 0; k < S; k++) if (weights[k] > 0) keys.push(k);
        ctx.fillStyle = "#444";
        for (let t = 0; t < S; t++) {
          ctx.textAlign = "right";
          ctx.fillStyle = t === q ? "#000" : "#777";
          ctx.fillText(shorten(label(t), 8), xl - 3, yOf(t, top) + 3);
          ctx.textAlign = "left";
          ctx.fillStyle = weights[t] < 0 ? "#bbb" : "#444";
          ctx.fillText(shorten(label(t), 8), xr + 3, yOf(t, top) + 3);
        }
      } else {
        keys = Array.from(weights.keys()).filter((k) => weights[k] > 0)
          .sort((a, b) => weights[b] - weights[a]).slice(0, LINES_TOP_KEYS);
        ctx.textAlign = "right";
        ctx.fillStyle = "#000";
        ctx.fillText(shorten(label(q), 8), xl - 3, yOf(q, top) + 3);
        ctx.textAlign = "left";
        ctx.fillStyle = "#444";
        for (const k of keys) ctx.fillText(shorten(label(k), 8), xr + 3, yOf(k, top) + 3);
        ctx.strokeStyle = "#ddd";
        ctx.beginPath();
        ctx.moveTo(xr, yOf(0, top));
        ctx.lineTo(xr, yOf(S - 1, top));
        ctx.stroke();
      }
      ctx.lineWidth = 2;
      for (const k of keys) {
        ctx.strokeStyle = headColour(h, Math.min(1, weights[k]));
        ctx.beginPath();
        ctx.moveTo(xl, yOf(q, top));
        ctx.lineTo(xr, yOf(k, top));
        ctx.stroke();
      }
      ctx.lineWidth = 1;
    }
    bump(canvas, "rendered");
  }

  async function showQuery() {
    if (!state.response) return;
    await busy("Fetching the query's row", async () => {
      showNotice("");
      await fetchRow();
    });
  }

  // --- (d) statistics --------------------------------------------------------

  const STAT_KEYS = ["entropy", "max_weight", "contribution"];

  function statRows() {
    const s = state.response.stats || {};
    const rows = [];
    for (let h = 0; h < state.H; h++) {
      const r = {head: h};
      for (const key of STAT_KEYS) r[key] = Array.isArray(s[key]) ? Number(s[key][h]) : NaN;
      rows.push(r);
    }
    const {key, dir} = state.sort;
    rows.sort((a, b) => dir * (a[key] - b[key]) || a.head - b.head);
    return rows;
  }

  function renderStats() {
    const table = $("stats-table");
    const body = table.tBodies[0];
    body.textContent = "";
    const rows = statRows();
    const maxOf = {};
    for (const key of STAT_KEYS) maxOf[key] = Math.max(1e-30, ...rows.map((r) => Math.abs(r[key]) || 0));
    for (const r of rows) {
      const tr = document.createElement("tr");
      if (state.headMask[r.head] === 0) tr.className = "removed";
      const td = document.createElement("td");
      td.textContent = String(r.head);
      tr.appendChild(td);
      for (const key of STAT_KEYS) {
        const cell = document.createElement("td");
        cell.className = "bar-cell";
        const text = document.createElement("span");
        text.textContent = Number.isFinite(r[key]) ? r[key].toPrecision(WEIGHT_DIGITS) : "-";
        const track = document.createElement("span");
        track.className = "bar-track";
        const bar = document.createElement("span");
        bar.className = "bar";
        bar.style.width = `${Math.round((80 * Math.abs(r[key] || 0)) / maxOf[key])}px`;
        track.appendChild(bar);
        cell.appendChild(text);
        cell.appendChild(track);
        tr.appendChild(cell);
      }
      body.appendChild(tr);
    }
    for (const th of table.tHead.rows[0].cells) {
      th.classList.toggle("sorted-asc", th.dataset.key === state.sort.key && state.sort.dir > 0);
      th.classList.toggle("sorted-desc", th.dataset.key === state.sort.key && state.sort.dir < 0);
    }
    bump(table, "rendered");
  }

  function onSort(event) {
    const th = event.target.closest("th");
    if (!th || !state.response) return;
    const key = th.dataset.key;
    state.sort = {key, dir: state.sort.key === key ? -state.sort.dir : (key === "head" ? 1 : -1)};
    renderStats();
  }

  // The table as a picture (the PNG export of the statistics).
  function renderStatsCanvas() {
    const canvas = $("stats-canvas");
    const rows = statRows();
    canvas.width = 620;
    canvas.height = 30 + 20 * rows.length;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.font = "12px sans-serif";
    ctx.fillStyle = "#222";
    const columns = [["head", 10], ["entropy", 60], ["max_weight", 240], ["contribution", 420]];
    for (const [name, x] of columns) ctx.fillText(name, x, 18);
    const maxOf = {};
    for (const key of STAT_KEYS) maxOf[key] = Math.max(1e-30, ...rows.map((r) => Math.abs(r[key]) || 0));
    rows.forEach((r, n) => {
      const y = 38 + 20 * n;
      ctx.fillStyle = "#222";
      ctx.fillText(String(r.head), 10, y);
      for (const [key, x] of columns.slice(1)) {
        ctx.fillStyle = "#222";
        ctx.fillText(Number.isFinite(r[key]) ? r[key].toPrecision(WEIGHT_DIGITS) : "-", x, y);
        ctx.fillStyle = "#3b6fb6";
        ctx.fillRect(x + 70, y - 9, (90 * Math.abs(r[key] || 0)) / maxOf[key], 9);
      }
    });
    return canvas;
  }

  // --- Head mask -------------------------------------------------------------

  function renderToggles() {
    const box = $("head-toggles");
    if (box.childElementCount !== state.H) {
      box.textContent = "";
      for (let h = 0; h < state.H; h++) {
        const l = document.createElement("label");
        const input = document.createElement("input");
        input.type = "checkbox";
        input.id = `head-toggle-${h}`;
        input.dataset.head = String(h);
        l.appendChild(input);
        l.appendChild(document.createTextNode(` head ${h}`));
        box.appendChild(l);
      }
    }
    for (const input of box.querySelectorAll("input")) input.checked = state.headMask[Number(input.dataset.head)] !== 0;
  }

  async function onToggle(event) {
    const input = event.target;
    if (!input.dataset || input.dataset.head === undefined || !state.base) return;
    state.headMask[Number(input.dataset.head)] = input.checked ? 1 : 0;
    await busy("Running with the head mask", async () => {
      showNotice("");
      await attend();
    });
  }

  function renderOutputChange() {
    const p = $("output-change");
    const out = state.response.output || {};
    const removed = [];
    state.headMask.forEach((g, h) => { if (g === 0) removed.push(h); });
    if (removed.length > 0 && typeof out.relative_change === "number") {
      const percent = (100 * out.relative_change).toPrecision(WEIGHT_DIGITS);
      p.textContent = `Removing head${removed.length > 1 ? "s" : ""} ${removed.join(", ")} changes the output by ` +
                      `${percent}% (relative norm of the difference, ||y - y_full|| / ||y_full||).`;
      p.dataset.relativeChange = String(out.relative_change);
      p.dataset.percent = percent;
    } else {
      p.textContent = `All heads on. Output norm ||y|| = ${typeof out.norm === "number" ? out.norm.toPrecision(6) : "?"}.`;
      p.dataset.relativeChange = "";
      p.dataset.percent = "";
    }
    p.dataset.removed = removed.join(",");
  }

  // --- (e) export ------------------------------------------------------------

  function offerDownload(blob, name) {
    if (state.downloadUrl) URL.revokeObjectURL(state.downloadUrl);
    state.downloadUrl = URL.createObjectURL(blob);
    const link = $("download-link");
    link.href = state.downloadUrl;
    link.download = name;
    link.textContent = `${name} (${formatBytes(blob.size)})`;
    $("download").hidden = false;
    link.click();
  }

  function fileStem() {
    const l = state.base && state.base.layer;
    const model = l ? `adhoc-d${l.d_model}-h${l.num_heads}-kv${l.num_kv_heads}-seed${l.seed}`
      : (state.base ? state.base.model : "model");
    return `attnserve-${model.replace(/[^A-Za-z0-9_.-]/g, "_")}-S${state.S}`;
  }

  // --- Decode session: what its latest token attends to ------------------------

  const SESSION_COLS = 860;  // pooled key columns asked for: one per pixel
  const SESSION_LEFT = 64;
  const SESSION_TOP = 8;
  const SESSION_ROW = 18;  // pixels per head
  const SESSION_AXIS = 30;

  async function showSession() {
    await busy("Reading the session", async () => {
      const id = $("session-id").value.trim();
      if (!/^[0-9A-Za-z]{1,128}$/.test(id)) {
        throw new UserError(`session id: "${shorten(id, 40)}" is not the id OpenSession returned (hex digits)`);
      }
      const layer = readInteger("session-layer", "layer", 0, 2147483647);
      const answer = await api("api/session", {session_id: id, layer, cols: SESSION_COLS});
      const data = base64ToF32(answer.data, "data");
      if (data.length !== answer.num_heads * answer.cols) {
        throw new Error(`data has ${data.length} values, not ${answer.num_heads} x ${answer.cols}`);
      }
      let vmax = 0;
      for (const v of data) if (v > vmax) vmax = v;
      state.session = Object.assign({}, answer, {data, vmax: vmax > 0 ? vmax : 1});
      state.labels = parseLabels();
      renderSession();
    });
  }

  function renderSession() {
    const s = state.session;
    const canvas = $("session-canvas");
    if (!s) return;
    const plotW = Math.max(s.cols, Math.min(SESSION_COLS, s.cols * Math.floor(SESSION_COLS / s.cols)));
    canvas.width = SESSION_LEFT + plotW + 16;
    canvas.height = SESSION_TOP + s.num_heads * SESSION_ROW + SESSION_AXIS;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    for (let h = 0; h < s.num_heads; h++) {
      paintMap(ctx, SESSION_LEFT, SESSION_TOP + h * SESSION_ROW, plotW, SESSION_ROW - 2, s.data, h * s.cols, 1,
               s.cols, s.vmax);
    }
    ctx.fillStyle = "#222";
    ctx.font = "11px sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let h = 0; h < s.num_heads; h++) {
      ctx.fillText(`head ${h}`, SESSION_LEFT - 6, SESSION_TOP + h * SESSION_ROW + (SESSION_ROW - 2) / 2);
    }
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    const axisY = SESSION_TOP + s.num_heads * SESSION_ROW + 4;
    ctx.fillText("key 0", SESSION_LEFT, axisY);
    ctx.textAlign = "right";
    ctx.fillText(`key ${s.length - 1} (the latest token, position ${s.position})`, SESSION_LEFT + plotW, axisY);
    state.sessionGeometry = {plotW};
    Object.assign(canvas.dataset, {plotX: String(SESSION_LEFT), plotY: String(SESSION_TOP), plotW: String(plotW),
                                   row: String(SESSION_ROW), cols: String(s.cols), pool: String(s.pool)});
    $("session-caption").textContent =
      `session ${shorten(s.session_id, 12)}, layer ${s.layer}: ${formatCount(s.length)} tokens, ` +
      `${s.num_heads} heads` + (s.pool > 1 ? `, each column the maximum of ${s.pool} keys` : "") +
      `; colour top ${formatWeight(s.vmax)}`;
    $("session-readout").textContent = "Hover over the rows.";
    bump(canvas, "rendered");
  }

  function onSessionMove(event) {
    const s = state.session;
    const g = state.sessionGeometry;
    if (!s || !g) return;
    const p = canvasPoint(event);
    const x = p.x - SESSION_LEFT;
    const y = p.y - SESSION_TOP;
    const head = Math.floor(y / SESSION_ROW);
    // The 2-pixel gap under each row belongs to no head.
    if (x < 0 || x >= g.plotW || y < 0 || head >= s.num_heads || y % SESSION_ROW >= SESSION_ROW - 2) return;
    const col = Math.min(s.cols - 1, Math.floor((x * s.cols) / g.plotW));
    const k0 = col * s.pool;
    const k1 = Math.min(s.length, k0 + s.pool);
    const weight = formatWeight(s.data[head * s.cols + col]);
    const readout = $("session-readout");
    readout.dataset.head = String(head);
    readout.dataset.key = String(k0);
    readout.dataset.weight = weight;
    const keys = k1 - k0 === 1 ? `key ${describePosition(k0)}` : `keys ${k0}-${k1 - 1} (maximum)`;
    readout.textContent = `head ${head} \u00b7 ${keys} \u00b7 weight ${weight}`;
  }

  // The session view's file name (without extension).
  function sessionStem() {
    const s = state.session;
    return `attnserve-session-${s.session_id.slice(0, 8)}-layer${s.layer}-len${s.length}` +
           `${s.pool > 1 ? `-pool${s.pool}` : ""}`;
  }

  function exportPng(canvasId) {
    if (canvasId === "session-canvas" && !state.session) return;
    const canvas = canvasId === "stats-canvas" ? renderStatsCanvas() : $(canvasId);
    const name = canvasId === "session-canvas" ? `${sessionStem()}.png`
      : `${fileStem()}-${canvasId.replace("-canvas", "")}.png`;
    canvas.toBlob((blob) => {
      if (blob) offerDownload(blob, name);
    }, "image/png");
  }

  function exportNpy(view) {
    if (view === "session") {
      const s = state.session;
      if (!s) return;
      // Full resolution when the answer was not pooled; else the pooled maxima.
      offerDownload(new Blob([npyBytes(s.data, [s.num_heads, s.cols])], {type: "application/octet-stream"}),
                    `${sessionStem()}.npy`);
      return;
    }
    if (!state.response) return;
    let values;
    let shape;
    if (view === "grid") {
      values = state.grid.data;
      shape = [state.H, state.grid.rows, state.grid.cols];
    } else if (view === "large") {
      const src = largeSource();
      values = src.data.subarray(src.offset, src.offset + src.rows * src.cols);
      shape = src.shape;
    } else if (view === "lines") {
      if (!state.row) return;
      values = state.row.data;
      shape = [state.H, state.S];
    } else {
      const s = state.response.stats || {};
      values = new Float32Array(3 * state.H);
      STAT_KEYS.forEach((key, n) => { for (let h = 0; h < state.H; h++) values[n * state.H + h] = s[key][h]; });
      shape = [3, state.H];
    }
    offerDownload(new Blob([npyBytes(values, shape)], {type: "application/octet-stream"}),
                  `${fileStem()}-${view}.npy`);
  }

  async function exportInputs() {
    await busy("Fetching the inputs", async () => {
      const base = await buildBase();
      if (base.inputs.npy) {
        offerDownload(new Blob([state.inputsBytes], {type: "application/octet-stream"}), state.uploadName);
        return;
      }
      const model = currentSource();
      const answer = await api("api/inputs", {seed: base.inputs.random.seed, seq_len: base.inputs.random.seq_len,
                                              d_model: model.d_model});
      offerDownload(new Blob([base64ToBytes(answer.npy)], {type: "application/octet-stream"}),
                    `attnserve-inputs-seed${base.inputs.random.seed}-S${base.inputs.random.seq_len}.npy`);
    });
  }

  // --- Wiring ----------------------------------------------------------------

  function onLabelsFile(event) {
    const file = event.target.files[0];
    if (!file) return;
    file.text().then((text) => {
      $("labels").value = text;
    });
  }

  function setUp() {
    $("request-form").addEventListener("submit", (event) => {
      event.preventDefault();
      run();
    });
    $("reload-models").addEventListener("click", loadModels);
    $("token").addEventListener("change", loadModels);
    $("model").addEventListener("change", showModelInfo);
    $("layer-fields").addEventListener("input", showLayerInfo);
    $("npy-file").addEventListener("change", () => { $("source-npy").checked = true; });
    $("labels-file").addEventListener("change", onLabelsFile);
    $("head-toggles").addEventListener("change", onToggle);
    $("grid-canvas").addEventListener("click", onGridClick);
    const large = $("large-canvas");
    large.addEventListener("mousemove", onLargeMove);
    large.addEventListener("mousedown", onLargeDown);
    window.addEventListener("mouseup", (event) => {
      if (state.drag) onLargeUp(event.target === large ? event : {target: large, clientX: event.clientX,
                                                                    clientY: event.clientY});
    });
    $("zoom-out").addEventListener("click", () => {
      if (!state.grid) return;
      state.region = null;
      renderLarge();
    });
    $("show-query").addEventListener("click", showQuery);
    $("show-session").addEventListener("click", showSession);
    $("session-id").addEventListener("keydown", (event) => {
      if (event.key === "Enter") {
        event.preventDefault();
        showSession();
      }
    });
    $("session-canvas").addEventListener("mousemove", onSessionMove);
    $("query").addEventListener("keydown", (event) => {
      if (event.key !== "Enter") return;
      event.preventDefault();
      showQuery();
    });
    $("stats-table").tHead.addEventListener("click", onSort);
    $("scale").addEventListener("change", () => {
      renderSession();
      if (!state.grid) return;
      renderLegend();
      renderGrid();
      renderLarge();
    });
    $("export-inputs").addEventListener("click", exportInputs);
    for (const b of document.querySelectorAll("[data-export-png]")) {
      b.addEventListener("click", () => exportPng(b.dataset.exportPng));
    }
    for (const b of document.querySelectorAll("[data-export-npy]")) {
      b.addEventListener("click", () => exportNpy(b.dataset.exportNpy));
    }
    renderLegend();
    loadModels();
  }

  setUp();
})();
