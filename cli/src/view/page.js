// oomguard view: the timeline and the memory map. Plain ES5-style script, no libraries, no
// network. The map at a moment is computed from the block lives and segment layouts exactly as
// `ViewData::map_at` does in Rust (cli/src/viewdata.rs); keep the two in step.
(function () {
  'use strict';

  var D = JSON.parse(document.getElementById('data').textContent);
  var NEVER = 0xffffffff;

  function buf(s) {
    var bin = atob(s), n = bin.length, u = new Uint8Array(n);
    for (var i = 0; i < n; i++) u[i] = bin.charCodeAt(i);
    return u.buffer;
  }
  var S = {
    n: D.samples.n,
    t: new Uint32Array(buf(D.samples.t)),
    live: new Float64Array(buf(D.samples.live)),
    reserved: new Float64Array(buf(D.samples.reserved))
  };
  var B = {
    n: D.blocks.n,
    addr: new Float64Array(buf(D.blocks.addr)),
    size: new Float64Array(buf(D.blocks.size)),
    slack: new Uint32Array(buf(D.blocks.slack)),
    t0: new Uint32Array(buf(D.blocks.t0)),
    t1: new Uint32Array(buf(D.blocks.t1)),
    meta: new Uint32Array(buf(D.blocks.meta))
  };
  var failAt = {};
  D.failures.forEach(function (f, i) { failAt[f.event] = i; });

  // ---- formatting -------------------------------------------------------------------------
  var UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  function fmtBytes(b) {
    var u = 0;
    while (Math.abs(b) >= 1024 && u < UNITS.length - 1) { b /= 1024; u++; }
    return (u === 0 ? String(Math.round(b)) : b.toFixed(b >= 100 ? 1 : 2)) + ' ' + UNITS[u];
  }
  function fmtInt(n) { return Math.round(n).toLocaleString('en-US'); }
  function hex(a) { return '0x' + a.toString(16); }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function streamName(ix) { return D.streams[ix] !== undefined ? D.streams[ix] : '?'; }

  // ---- colours ----------------------------------------------------------------------------
  var SIZE_BUCKETS = [
    { max: 1 << 20, color: '#9ecae1', label: '< 1 MiB' },
    { max: 16 << 20, color: '#6baed6', label: '1–16 MiB' },
    { max: 128 << 20, color: '#3182bd', label: '16–128 MiB' },
    { max: 1024 * 1024 * 1024, color: '#08519c', label: '128 MiB–1 GiB' },
    { max: Infinity, color: '#54278f', label: '≥ 1 GiB' }
  ];
  var FREE = '#fdbf6f', UNMAPPED = '#e6e8ec', LARGEST = '#1b7f3b';
  function bucket(size) {
    for (var i = 0; i < SIZE_BUCKETS.length; i++) if (size < SIZE_BUCKETS[i].max) return i;
    return SIZE_BUCKETS.length - 1;
  }

  // ---- the map at a moment ----------------------------------------------------------------
  function layoutAt(t) {
    var L = D.layouts, lo = 0, hi = L.length - 1, best = -1;
    while (lo <= hi) {
      var mid = (lo + hi) >> 1;
      if (L[mid].e <= t) { best = mid; lo = mid + 1; } else hi = mid - 1;
    }
    return best < 0 ? null : L[best];
  }

  // Spans of each segment in address order: kind 0 = block (i), 1 = free, 2 = unmapped.
  function computeMap(t) {
    // Blocks are in allocation order, so only those allocated by event t can be alive.
    var lim = 0, hiB = B.n;
    while (lim < hiB) { var m = (lim + hiB) >> 1; if (B.t0[m] <= t) lim = m + 1; else hiB = m; }
    var live = [];
    for (var i = 0; i < lim; i++) if (t < B.t1[i]) live.push(i);
    live.sort(function (a, b) { return B.addr[a] - B.addr[b]; });
    var L = layoutAt(t);
    var map = { t: t, segs: [], allocated: 0, requested: 0, free: 0, mapped: 0, unmapped: 0,
      largest: null, blocks: live.length, total: 0 };
    if (!L) return map;
    var addrs = live.map(function (i) { return B.addr[i]; });
    function firstAtOrAfter(a) {
      var lo = 0, hi = addrs.length;
      while (lo < hi) { var m = (lo + hi) >> 1; if (addrs[m] < a) lo = m + 1; else hi = m; }
      return lo;
    }
    L.s.forEach(function (s, si) {
      var base = s[0], extent = s[1], mapped = s[4], spans = [];
      var cur = base;
      function free(a, b) {
        if (b <= a) return;
        spans.push({ a: a, len: b - a, k: 1 });
        map.free += b - a;
        if (!map.largest || b - a > map.largest.len) map.largest = { a: a, len: b - a, seg: si };
      }
      for (var r = 0; r < mapped.length; r += 2) {
        var start = mapped[r], end = mapped[r + 1];
        if (start > cur) { spans.push({ a: cur, len: start - cur, k: 2 }); map.unmapped += start - cur; }
        map.mapped += end - start;
        var c = start;
        for (var j = firstAtOrAfter(start); j < live.length && addrs[j] < end; j++) {
          var bi = live[j], a = B.addr[bi], sz = B.size[bi];
          free(c, a);
          spans.push({ a: a, len: sz, k: 0, i: bi });
          map.allocated += sz;
          map.requested += sz - B.slack[bi];
          c = Math.max(c, a + sz);
        }
        free(c, end);
        cur = end;
      }
      if (base + extent > cur) { spans.push({ a: cur, len: base + extent - cur, k: 2 }); map.unmapped += base + extent - cur; }
      map.total += extent;
      map.segs.push({ base: base, extent: extent, stream: s[2], growable: s[3], spans: spans });
    });
    return map;
  }

  // ---- canvases ---------------------------------------------------------------------------
  var dpr = Math.max(1, window.devicePixelRatio || 1);
  function fit(canvas, cssHeight) {
    var w = canvas.parentNode.clientWidth;
    canvas.style.height = cssHeight + 'px';
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(cssHeight * dpr);
    var ctx = canvas.getContext('2d');
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { ctx: ctx, w: w, h: cssHeight };
  }

  function niceStep(range, target) {
    var raw = range / Math.max(1, target), p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
  }
  function byteTicks(max, target) {
    var u = 0, scale = 1;
    while (max / scale >= 1024 * 2 && u < UNITS.length - 1) { scale *= 1024; u++; }
    var step = niceStep(max / scale, target) * scale, ticks = [];
    for (var v = 0; v <= max * 1.0001; v += step) ticks.push(v);
    return { ticks: ticks, label: function (v) { return +(v / scale).toFixed(3) + ' ' + UNITS[u]; } };
  }

  // ---- timeline ---------------------------------------------------------------------------
  var tl = document.getElementById('timeline');
  var view = { x0: 0, x1: Math.max(1, D.events) }, sel = 0;
  var M = { l: 78, r: 18, t: 16, b: 34 };
  var tlGeom = null;

  function sampleRange(x0, x1) {
    var lo = 0, hi = S.n;
    while (lo < hi) { var m = (lo + hi) >> 1; if (S.t[m] < x0) lo = m + 1; else hi = m; }
    var a = Math.max(0, lo - 1);
    lo = a; hi = S.n;
    while (lo < hi) { var m2 = (lo + hi) >> 1; if (S.t[m2] <= x1) lo = m2 + 1; else hi = m2; }
    return [a, Math.min(S.n, lo + 1)];
  }

  function drawTimeline() {
    var g = fit(tl, 300), ctx = g.ctx, pw = g.w - M.l - M.r, ph = g.h - M.t - M.b;
    var span = view.x1 - view.x0;
    var r = sampleRange(view.x0, view.x1), ymax = 1;
    for (var i = r[0]; i < r[1]; i++) ymax = Math.max(ymax, S.reserved[i], S.live[i]);
    var showCap = D.capacity <= ymax * 1.6;
    if (showCap) ymax = Math.max(ymax, D.capacity);
    ymax *= 1.08;
    function X(e) { return M.l + (e - view.x0) / span * pw; }
    function Y(b) { return M.t + ph - b / ymax * ph; }
    tlGeom = { X: X, pw: pw, span: span };
    ctx.clearRect(0, 0, g.w, g.h);
    ctx.font = '11.5px system-ui, sans-serif';
    // grid and y ticks
    var yt = byteTicks(ymax, 5);
    ctx.textAlign = 'right'; ctx.textBaseline = 'middle';
    yt.ticks.forEach(function (v) {
      var y = Y(v);
      ctx.strokeStyle = '#eceef2'; ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(M.l, Math.round(y) + 0.5); ctx.lineTo(M.l + pw, Math.round(y) + 0.5); ctx.stroke();
      ctx.fillStyle = '#5d6677'; ctx.fillText(yt.label(v), M.l - 8, y);
    });
    // x ticks (events)
    var step = Math.max(1, niceStep(span, Math.max(3, Math.floor(pw / 110))));
    ctx.textAlign = 'center'; ctx.textBaseline = 'top';
    for (var e = Math.ceil(view.x0 / step) * step; e <= view.x1; e += step) {
      var x = X(e);
      ctx.strokeStyle = '#f1f2f5';
      ctx.beginPath(); ctx.moveTo(Math.round(x) + 0.5, M.t); ctx.lineTo(Math.round(x) + 0.5, M.t + ph); ctx.stroke();
      ctx.strokeStyle = '#9aa1ad';
      ctx.beginPath(); ctx.moveTo(Math.round(x) + 0.5, M.t + ph); ctx.lineTo(Math.round(x) + 0.5, M.t + ph + 4); ctx.stroke();
      ctx.fillStyle = '#5d6677'; ctx.fillText(fmtInt(e), x, M.t + ph + 6);
    }
    ctx.fillText('event', M.l + pw / 2, M.t + ph + 19);
    ctx.save();
    ctx.beginPath(); ctx.rect(M.l, M.t - 2, pw, ph + 2); ctx.clip();
    // reserved: filled; live: line
    function path(arr) {
      ctx.beginPath();
      for (var i = r[0]; i < r[1]; i++) {
        var x = X(S.t[i]), y = Y(arr[i]);
        if (i === r[0]) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      }
    }
    if (r[1] > r[0]) {
      path(S.reserved);
      ctx.lineTo(X(S.t[r[1] - 1]), Y(0)); ctx.lineTo(X(S.t[r[0]]), Y(0)); ctx.closePath();
      ctx.fillStyle = 'rgba(240, 140, 46, 0.16)'; ctx.fill();
      path(S.reserved); ctx.strokeStyle = '#f08c2e'; ctx.lineWidth = 1.6; ctx.stroke();
      path(S.live); ctx.strokeStyle = '#2166ac'; ctx.lineWidth = 1.6; ctx.stroke();
    }
    if (showCap) {
      ctx.setLineDash([6, 4]); ctx.strokeStyle = '#6b7280'; ctx.lineWidth = 1;
      var cy = Math.round(Y(D.capacity)) + 0.5;
      ctx.beginPath(); ctx.moveTo(M.l, cy); ctx.lineTo(M.l + pw, cy); ctx.stroke(); ctx.setLineDash([]);
      ctx.fillStyle = '#4b5563'; ctx.textAlign = 'right'; ctx.textBaseline = 'bottom';
      ctx.fillText('capacity ' + fmtBytes(D.capacity), M.l + pw - 4, cy - 2);
    }
    // OOMs
    D.failures.forEach(function (f) {
      if (f.event < view.x0 || f.event > view.x1) return;
      var x = Math.round(X(f.event)) + 0.5;
      ctx.strokeStyle = 'rgba(214, 39, 40, 0.55)'; ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(x, M.t); ctx.lineTo(x, M.t + ph); ctx.stroke();
      ctx.fillStyle = '#d62728';
      ctx.beginPath(); ctx.moveTo(x - 5, M.t); ctx.lineTo(x + 5, M.t); ctx.lineTo(x, M.t + 8); ctx.closePath(); ctx.fill();
    });
    // the moment shown in the map
    if (sel >= view.x0 && sel <= view.x1) {
      var sx = Math.round(X(sel)) + 0.5;
      ctx.setLineDash([4, 3]); ctx.strokeStyle = '#1d2330'; ctx.lineWidth = 1.2;
      ctx.beginPath(); ctx.moveTo(sx, M.t); ctx.lineTo(sx, M.t + ph); ctx.stroke(); ctx.setLineDash([]);
    }
    ctx.restore();
    ctx.strokeStyle = '#c4c9d2'; ctx.lineWidth = 1;
    ctx.strokeRect(M.l + 0.5, M.t + 0.5, pw, ph);
  }

  function eventAt(px) {
    var e = view.x0 + (px - M.l) / tlGeom.pw * tlGeom.span;
    return Math.max(0, Math.min(D.events - 1, Math.round(e)));
  }

  function clampView(x0, x1) {
    var w = Math.max(Math.min(20, D.events), Math.min(D.events, x1 - x0));
    x0 = Math.max(0, Math.min(D.events - w, x0));
    view.x0 = x0; view.x1 = x0 + w;
  }

  tl.addEventListener('wheel', function (ev) {
    ev.preventDefault();
    var rect = tl.getBoundingClientRect(), px = ev.clientX - rect.left;
    var at = view.x0 + (px - M.l) / tlGeom.pw * tlGeom.span;
    var f = Math.exp((ev.deltaY || ev.deltaX) * 0.0015);
    clampView(at - (at - view.x0) * f, at + (view.x1 - at) * f);
    drawTimeline();
  }, { passive: false });

  var drag = null;
  tl.addEventListener('mousedown', function (ev) {
    drag = { x: ev.clientX, x0: view.x0, x1: view.x1, moved: false };
  });
  window.addEventListener('mousemove', function (ev) {
    if (drag) {
      var dx = ev.clientX - drag.x;
      if (Math.abs(dx) > 3) drag.moved = true;
      if (drag.moved) {
        var de = -dx / tlGeom.pw * (drag.x1 - drag.x0);
        clampView(drag.x0 + de, drag.x1 + de);
        drawTimeline();
      }
    }
  });
  window.addEventListener('mouseup', function (ev) {
    if (drag && !drag.moved && ev.target === tl) {
      var rect = tl.getBoundingClientRect();
      select(eventAt(ev.clientX - rect.left));
    }
    drag = null;
  });
  tl.addEventListener('mousemove', function (ev) {
    if (drag && drag.moved) { hideTip(); return; }
    var rect = tl.getBoundingClientRect(), px = ev.clientX - rect.left;
    if (px < M.l || px > M.l + tlGeom.pw) { hideTip(); return; }
    var e = eventAt(px), lines = ['event ' + fmtInt(e)];
    var r = sampleRange(e, e), k = Math.min(S.n - 1, r[0] + 1);
    while (k > 0 && S.t[k - 1] >= e) k--;
    if (S.n) {
      var per = Math.max(1, Math.ceil(D.events / Math.max(1, S.n)));
      lines.push((per > 1 ? 'most over ' + per + ' events: ' : '') + 'live ' + fmtBytes(S.live[k]) +
        ', reserved ' + fmtBytes(S.reserved[k]));
    }
    D.failures.forEach(function (f) {
      if (Math.abs(tlGeom.X(f.event) - px) <= 4) {
        lines.push('✖ event ' + fmtInt(f.event) + ': ' + fmtBytes(f.bytes) + ' failed');
      }
    });
    lines.push('click: the memory map here');
    showTip(ev, lines.join('\n'));
  });
  tl.addEventListener('mouseleave', hideTip);
  document.getElementById('reset').addEventListener('click', function () {
    view.x0 = 0; view.x1 = Math.max(1, D.events); drawTimeline();
  });
  document.addEventListener('keydown', function (ev) {
    if (ev.key !== 'ArrowLeft' && ev.key !== 'ArrowRight') return;
    var d = (ev.key === 'ArrowLeft' ? -1 : 1) * (ev.shiftKey ? 100 : 1);
    select(Math.max(0, Math.min(D.events - 1, sel + d)));
    ev.preventDefault();
  });

  // ---- tooltip ----------------------------------------------------------------------------
  var tip = document.getElementById('tip');
  function showTip(ev, text) {
    tip.textContent = text;
    tip.hidden = false;
    var x = ev.clientX + 14, y = ev.clientY + 14;
    var w = tip.offsetWidth, h = tip.offsetHeight;
    if (x + w > window.innerWidth - 8) x = ev.clientX - w - 14;
    if (y + h > window.innerHeight - 8) y = ev.clientY - h - 14;
    tip.style.left = x + 'px'; tip.style.top = y + 'px';
  }
  function hideTip() { tip.hidden = true; }

  // ---- memory map -------------------------------------------------------------------------
  var mapCanvas = document.getElementById('map');
  var current = null, geom = null;
  var ROW = 22, GAP = 9, SEG_GAP = 5;

  // Unmapped stretches of growable ranges are drawn at most this wide: they hold no memory, and
  // to scale they crowd out what does.
  var UNMAPPED_PX = 8;

  function drawMap(map) {
    var w = mapCanvas.parentNode.clientWidth, nseg = map.segs.length, nunmapped = 0;
    map.segs.forEach(function (s) { s.spans.forEach(function (sp) { if (sp.k === 2) nunmapped++; }); });
    // Bytes per pixel: the mapped bytes in about 12 rows, beside the gaps and unmapped marks.
    var rows = 12, avail = Math.max(w, w * rows - nseg * SEG_GAP - nunmapped * UNMAPPED_PX);
    var bpp = Math.max(1, map.mapped) / avail;
    var gx = 0;
    map.segs.forEach(function (s) {
      s.g0 = gx;
      s.spans.forEach(function (sp) {
        sp.g0 = gx;
        gx += sp.k === 2 ? Math.max(2, Math.min(UNMAPPED_PX, sp.len / bpp)) : sp.len / bpp;
        sp.g1 = gx;
      });
      s.g1 = gx;
      gx += SEG_GAP;
    });
    var nrows = Math.max(1, Math.ceil(gx / w));
    var g = fit(mapCanvas, Math.max(120, nrows * (ROW + GAP) + 8)), ctx = g.ctx;
    ctx.clearRect(0, 0, g.w, g.h);
    // Pixel bins merge what is narrower than a pixel; the colour with most coverage wins.
    var bin = { px: -1, w: {} };
    function flush() {
      if (bin.px < 0) return;
      var best = null, bw = 0;
      for (var c in bin.w) if (bin.w[c] > bw) { bw = bin.w[c]; best = c; }
      if (best && bw > 0.05) rect(bin.px, bin.px + 1, best);
      bin.px = -1; bin.w = {};
    }
    function rect(a, b, color) {
      // a, b: strip pixels; split across rows
      while (a < b) {
        var row = Math.floor(a / w), end = Math.min(b, (row + 1) * w);
        ctx.fillStyle = color;
        ctx.fillRect(a - row * w, 4 + row * (ROW + GAP), end - a, ROW);
        a = end;
      }
    }
    function paint(a, b, color) {
      var pa = Math.floor(a), pb = Math.floor(b);
      if (pa === pb) {
        if (bin.px !== pa) { flush(); bin.px = pa; }
        bin.w[color] = (bin.w[color] || 0) + (b - a);
        return;
      }
      if (bin.px !== pa) { flush(); bin.px = pa; }
      bin.w[color] = (bin.w[color] || 0) + (pa + 1 - a);
      flush();
      if (pb > pa + 1) rect(pa + 1, pb, color);
      if (b > pb) { bin.px = pb; bin.w = {}; bin.w[color] = b - pb; }
    }
    var edges = [];
    map.segs.forEach(function (s) {
      s.spans.forEach(function (sp) {
        var color = sp.k === 0 ? SIZE_BUCKETS[bucket(sp.len)].color : sp.k === 1 ? FREE : UNMAPPED;
        paint(sp.g0, sp.g1, color);
        if (sp.k === 0 && sp.g1 - sp.g0 >= 4) edges.push(sp.g0);
      });
      flush();
    });
    flush();
    function bar(a, b, fn) {
      while (a < b) {
        var row = Math.floor(a / w), end = Math.min(b, (row + 1) * w);
        fn(a - row * w, row, end - a);
        a = end;
      }
    }
    // unmapped stretches hatched, block boundaries (where wide enough to see), segment starts
    ctx.strokeStyle = '#c9cdd5'; ctx.lineWidth = 1;
    map.segs.forEach(function (s) {
      s.spans.forEach(function (sp) {
        if (sp.k !== 2) return;
        bar(sp.g0, sp.g1, function (x, row, len) {
          var y = 4 + row * (ROW + GAP);
          ctx.save(); ctx.beginPath(); ctx.rect(x, y, len, ROW); ctx.clip();
          for (var d = -ROW; d < len; d += 4) { ctx.beginPath(); ctx.moveTo(x + d, y + ROW); ctx.lineTo(x + d + ROW, y); ctx.stroke(); }
          ctx.restore();
        });
      });
    });
    ctx.fillStyle = 'rgba(255, 255, 255, 0.85)';
    edges.forEach(function (a) {
      var row = Math.floor(a / w);
      ctx.fillRect(Math.round(a - row * w), 4 + row * (ROW + GAP), 1, ROW);
    });
    ctx.fillStyle = '#1d2330';
    map.segs.forEach(function (s) {
      var row = Math.floor(s.g0 / w);
      ctx.fillRect(Math.round(s.g0 - row * w), 1 + row * (ROW + GAP), 2, ROW + 6);
    });
    if (map.largest) {
      var big = null;
      map.segs[map.largest.seg].spans.forEach(function (sp) { if (sp.k === 1 && sp.a === map.largest.a) big = sp; });
      if (big) {
        ctx.strokeStyle = LARGEST; ctx.lineWidth = 2.5;
        bar(big.g0, Math.max(big.g1, big.g0 + 3), function (x, row, len) {
          ctx.strokeRect(x, 3 + row * (ROW + GAP), Math.max(3, len), ROW + 2);
        });
      }
    }
    if (!map.segs.length) {
      ctx.fillStyle = '#5d6677'; ctx.font = '13px system-ui, sans-serif';
      ctx.fillText('No memory reserved at this moment.', 8, 40);
    }
    geom = { w: w };
  }

  function spanAt(map, px, py) {
    if (!geom) return null;
    var row = Math.floor((py - 4) / (ROW + GAP));
    if (row < 0 || py - 4 - row * (ROW + GAP) > ROW) return null;
    var gx = row * geom.w + px;
    for (var i = 0; i < map.segs.length; i++) {
      var s = map.segs[i];
      if (gx >= s.g0 && gx < s.g1) {
        var sp = s.spans, lo = 0, hi = sp.length - 1, best = -1;
        while (lo <= hi) { var m = (lo + hi) >> 1; if (sp[m].g0 <= gx) { best = m; lo = m + 1; } else hi = m - 1; }
        return best < 0 ? null : { seg: i, span: sp[best], s: s };
      }
    }
    return null;
  }

  mapCanvas.addEventListener('mousemove', function (ev) {
    var rect = mapCanvas.getBoundingClientRect();
    var hit = current && spanAt(current, ev.clientX - rect.left, ev.clientY - rect.top);
    if (!hit) { hideTip(); return; }
    var sp = hit.span, lines;
    var segLine = 'segment #' + (hit.seg + 1) + ' at ' + hex(hit.s.base) + ' (' +
      (hit.s.growable ? 'growable' : 'fixed') + ', stream ' + streamName(hit.s.stream) + ')';
    if (sp.k === 0) {
      var i = sp.i, site = B.meta[i] >>> 8, t1 = B.t1[i];
      lines = ['Allocated block: ' + fmtBytes(B.size[i]) + ' (asked for ' + fmtBytes(B.size[i] - B.slack[i]) + ')',
        'address ' + hex(B.addr[i]) + ', stream ' + streamName(B.meta[i] & 0xff),
        'allocated at event ' + fmtInt(B.t0[i]) + (t1 === NEVER ? ', live to the end' : ', freed at event ' + fmtInt(t1)),
        segLine];
      lines.push(site > 0 ? '\nallocated at:\n' + D.sites[site - 1] : '\n(no stack frames in this trace)');
    } else if (sp.k === 1) {
      var big = current.largest && current.largest.a === sp.a;
      lines = [(big ? 'The largest free range: ' : 'Free (cached, not in use): ') + fmtBytes(sp.len),
        'address ' + hex(sp.a), segLine];
    } else {
      lines = ['Unmapped: ' + fmtBytes(sp.len) + ' of address range, no memory behind it', segLine];
    }
    showTip(ev, lines.join('\n'));
  });
  mapCanvas.addEventListener('mouseleave', hideTip);

  // ---- facts ------------------------------------------------------------------------------
  function row(table, k, v) {
    var tr = el('tr');
    tr.appendChild(el('td', null, k));
    tr.appendChild(el('td', null, v));
    table.appendChild(tr);
  }

  function showFacts(map) {
    var f = document.getElementById('facts');
    f.textContent = '';
    var fi = failAt[map.t];
    var why = el('div', 'why');
    if (fi !== undefined) {
      var fl = D.failures[fi], largest = map.largest ? map.largest.len : 0;
      why.appendChild(el('b', null, '✖ ' + fmtBytes(fl.bytes) + ' on stream ' + fl.stream + ' failed here'));
      var text;
      if (map.free >= fl.bytes && largest < fl.bytes) {
        text = 'Fragmentation: ' + fmtBytes(map.free) + ' is free in the cache, but the largest free range is ' +
          fmtBytes(largest) + ', smaller than the request.';
      } else if (largest >= fl.bytes) {
        text = 'A free range of ' + fmtBytes(largest) + ' exists but serves another stream or pool.';
      } else {
        text = 'Not enough memory: ' + fmtBytes(map.requested) + ' live and ' + fmtBytes(map.free) +
          ' cached of ' + fmtBytes(D.capacity) + '.';
      }
      why.appendChild(el('div', null, text));
      var msg = el('div', null, fl.message);
      msg.style.cssText = 'color:#5d6677;font-size:12px;margin-top:4px';
      why.appendChild(msg);
    } else {
      why.className = 'why ok';
      why.appendChild(el('b', null, map.t === D.peak_event ? 'Peak of live memory' : 'No failure at this event'));
      why.appendChild(el('div', null, map.requested > 0
        ? 'Reserved is ' + (map.mapped / map.requested).toFixed(3) + '× the live bytes here.'
        : 'Nothing live here.'));
    }
    f.appendChild(why);
    f.appendChild(el('h3', null, 'After event ' + fmtInt(map.t) + ' of ' + fmtInt(D.events)));
    var table = el('table');
    row(table, 'live (asked for)', fmtBytes(map.requested));
    row(table, 'in allocated blocks', fmtBytes(map.allocated));
    row(table, 'free in the cache', fmtBytes(map.free));
    row(table, 'reserved (mapped)', fmtBytes(map.mapped));
    if (map.unmapped > 0) row(table, 'unmapped address range', fmtBytes(map.unmapped));
    row(table, 'largest free range', map.largest
      ? fmtBytes(map.largest.len) + ' in segment #' + (map.largest.seg + 1) : 'none');
    if (map.largest) row(table, '', 'at ' + hex(map.largest.a));
    row(table, 'segments', fmtInt(map.segs.length));
    row(table, 'allocated blocks', fmtInt(map.blocks));
    f.appendChild(table);
    var root = document.documentElement;
    root.setAttribute('data-selected', String(map.t));
    root.setAttribute('data-largest-free', String(map.largest ? map.largest.len : 0));
    root.setAttribute('data-free', String(map.free));
    root.setAttribute('data-allocated', String(map.allocated));
  }

  function select(t) {
    sel = t;
    var t0 = performance.now();
    current = computeMap(t);
    drawMap(current);
    showFacts(current);
    document.getElementById('map-title').textContent = 'Memory map after event ' + fmtInt(t) +
      (failAt[t] !== undefined ? ' — out of memory' : t === D.peak_event ? ' — peak of live memory' : '');
    document.documentElement.setAttribute('data-map-ms', (performance.now() - t0).toFixed(1));
    drawTimeline();
  }

  // ---- header, legends, jumps -------------------------------------------------------------
  function header() {
    document.getElementById('title').textContent = D.title;
    var sm = document.getElementById('summary');
    function chip(label, value, cls) {
      var c = el('span', 'chip' + (cls ? ' ' + cls : ''));
      c.appendChild(document.createTextNode(label + ' '));
      c.appendChild(el('b', null, value));
      sm.appendChild(c);
    }
    chip('format', D.format);
    chip('config', D.config);
    chip('capacity', fmtBytes(D.capacity));
    chip('events', fmtInt(D.events));
    chip('peak live', fmtBytes(D.peak_live));
    chip('peak reserved', fmtBytes(D.peak_reserved));
    chip('reserved / live', D.ratio.toFixed(4));
    chip('failed allocations', fmtInt(D.failures_total), D.failures_total ? 'bad' : 'good');
    var notes = document.getElementById('notes');
    D.notes.forEach(function (n) { notes.appendChild(el('li', null, n)); });
    if (D.layouts_truncated) notes.appendChild(el('li', null, 'Segment layouts stopped being recorded part-way (too many); later maps show the last one kept.'));
    var per = Math.max(1, Math.ceil(D.events / Math.max(1, S.n)));
    var lg = document.getElementById('tl-legend');
    [['ln', '#2166ac', 'live bytes'], ['ln', '#f08c2e', 'reserved bytes'], ['ln', '#d62728', 'failed allocation']]
      .forEach(function (x) {
        var s = el('span'), sw = el('span', x[0]);
        sw.style.borderColor = x[1];
        s.appendChild(sw); s.appendChild(document.createTextNode(x[2])); lg.appendChild(s);
      });
    if (per > 1) lg.appendChild(el('span', null, 'each point: the most over ' + fmtInt(per) + ' events'));
    var ml = document.getElementById('map-legend');
    SIZE_BUCKETS.forEach(function (b) {
      var s = el('span'), sw = el('span', 'sw'); sw.style.background = b.color;
      s.appendChild(sw); s.appendChild(document.createTextNode('block ' + b.label)); ml.appendChild(s);
    });
    [[FREE, 'free (cached)'], [UNMAPPED, 'unmapped (not to scale)']].forEach(function (x) {
      var s = el('span'), sw = el('span', 'sw'); sw.style.background = x[0];
      s.appendChild(sw); s.appendChild(document.createTextNode(x[1])); ml.appendChild(s);
    });
    var s = el('span'), sw = el('span', 'sw');
    sw.style.cssText = 'background:transparent;border:2.5px solid ' + LARGEST;
    s.appendChild(sw); s.appendChild(document.createTextNode('largest free range')); ml.appendChild(s);
    var s2 = el('span'), sw2 = el('span', 'sw');
    sw2.style.cssText = 'background:#1d2330;width:3px';
    s2.appendChild(sw2); s2.appendChild(document.createTextNode('segment start')); ml.appendChild(s2);
    var jump = document.getElementById('jump');
    var pk = el('button', null, 'Peak live (event ' + fmtInt(D.peak_event) + ')');
    pk.type = 'button';
    pk.addEventListener('click', function () { select(D.peak_event); });
    jump.appendChild(pk);
    D.failures.slice(0, 12).forEach(function (f, i) {
      var b = el('button', 'oom', '✖ OOM ' + (i + 1) + ': ' + fmtBytes(f.bytes) + ' @ ' + fmtInt(f.event));
      b.type = 'button';
      b.addEventListener('click', function () { select(f.event); });
      jump.appendChild(b);
    });
    if (D.failures_total > 12) jump.appendChild(el('span', null, '+' + fmtInt(D.failures_total - 12) + ' more'));
  }

  header();
  select(D.failures.length ? D.failures[0].event : Math.min(D.peak_event, Math.max(0, D.events - 1)));
  var resizeTimer = null;
  window.addEventListener('resize', function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () { if (current) drawMap(current); drawTimeline(); }, 80);
  });
  // `page.html#selftest`: hover the widest allocated block of the map and keep what the tooltip
  // says in data-tip, for the headless browser check (which cannot move a mouse).
  if (location.hash === '#selftest' && current) {
    var best = null;
    current.segs.forEach(function (s) {
      s.spans.forEach(function (sp) { if (sp.k === 0 && (!best || sp.g1 - sp.g0 > best.g1 - best.g0)) best = sp; });
    });
    if (best) {
      var mid = (best.g0 + best.g1) / 2, r = Math.floor(mid / geom.w), rc = mapCanvas.getBoundingClientRect();
      mapCanvas.dispatchEvent(new MouseEvent('mousemove', {
        clientX: rc.left + mid - r * geom.w, clientY: rc.top + 4 + r * (ROW + GAP) + ROW / 2
      }));
      document.documentElement.setAttribute('data-tip', tip.textContent);
    }
  }
  document.documentElement.setAttribute('data-ready', '1');
})();
