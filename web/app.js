// Strata's page: chat (streamed from /v1/chat/completions) and monitor (polls /status), with its
// own small markdown renderer and code highlighter. No outside resources. Everything the model
// writes is escaped before it reaches innerHTML; links keep only http(s), mailto and relative URLs.
'use strict';

// ============================================================================================
// Escaping, markdown and highlighting

const ESC = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
function esc(s) { return String(s).replace(/[&<>"']/g, (c) => ESC[c]); }

// A link target is kept only with no scheme (relative) or http, https, mailto. Control characters
// and spaces are refused outright: browsers drop them inside a scheme ("java\x01script:").
function safeUrl(url) {
  if (/[\x00-\x20\x7f]/.test(url)) return false;
  const scheme = /^([a-z][a-z0-9+.-]*):/i.exec(url);
  return !scheme || /^(https?|mailto)$/i.test(scheme[1]);
}

// Inline spans of one block's text. Code spans are cut out first (their contents stay literal),
// the rest is escaped, then links and emphasis are applied to the escaped text; \u0001 marks a
// code span's place (the input never holds one: renderMarkdown removes them).
function renderInline(text) {
  const codes = [];
  let s = text.replace(/(`+)([\s\S]*?[^`])\1(?!`)/g, (m, ticks, body) => {
    codes.push('<code>' + esc(body.replace(/^ (.*) $/s, '$1')) + '</code>');
    return '\u0001' + (codes.length - 1) + '\u0001';
  });
  s = esc(s);
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (m, label, url) => {
    const raw = url.replace(/&amp;/g, '&').replace(/&#39;/g, "'").replace(/&quot;/g, '"');
    return safeUrl(raw) ? `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>` : m;
  });
  s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, '<strong>$1</strong>')
       .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, '$1<strong>$2</strong>')
       .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![*\w])/g, '$1<em>$2</em>')
       .replace(/(^|[^_\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?![_\w])/g, '$1<em>$2</em>')
       .replace(/~~(?=\S)([\s\S]*?\S)~~/g, '<del>$1</del>');
  return s.replace(/\u0001(\d+)\u0001/g, (m, i) => codes[+i]);
}

const RE_FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const RE_HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RE_HR = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const RE_QUOTE = /^ {0,3}> ?/;
const RE_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const RE_TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function isTableStart(lines, i) {
  return lines[i].includes('|') && i + 1 < lines.length && lines[i + 1].includes('-') &&
    (lines[i].trim().startsWith('|') || lines[i + 1].includes('|')) && RE_TABLE_SEP.test(lines[i + 1]);
}
function startsBlock(lines, i) {
  const l = lines[i];
  return RE_FENCE.test(l) || RE_HEADING.test(l) || RE_HR.test(l) || RE_QUOTE.test(l) ||
    RE_ITEM.test(l) || isTableStart(lines, i);
}
function splitRow(line) {
  let s = line.trim();
  if (s.startsWith('|')) s = s.slice(1);
  if (s.endsWith('|') && !s.endsWith('\\|')) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, '|'));
}

function renderTable(lines, i, out) {
  const head = splitRow(lines[i]);
  const align = splitRow(lines[i + 1]).map((c) =>
    c.startsWith(':') && c.endsWith(':') ? 'center' : c.endsWith(':') ? 'right' : c.startsWith(':') ? 'left' : '');
  const cell = (tag, text, k) =>
    `<${tag}${align[k] ? ` style="text-align:${align[k]}"` : ''}>${renderInline(text || '')}</${tag}>`;
  let html = '<table><thead><tr>' + head.map((c, k) => cell('th', c, k)).join('') + '</tr></thead><tbody>';
  for (i += 2; i < lines.length && lines[i].includes('|') && lines[i].trim(); i++) {
    const row = splitRow(lines[i]);
    html += '<tr>' + head.map((_, k) => cell('td', row[k], k)).join('') + '</tr>';
  }
  out.push(html + '</tbody></table>');
  return i;
}

// A list: items at the first item's indentation; deeper lines belong to the item before them
// and are rendered as markdown of their own (nested lists, code blocks).
function renderList(lines, i, out) {
  const first = RE_ITEM.exec(lines[i]);
  const indent = first[1].length, ordered = /\d/.test(first[2]);
  const items = [];
  let loose = false;
  while (i < lines.length) {
    const l = lines[i], m = RE_ITEM.exec(l);
    if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
      items.push({ lines: [m[3]], pad: indent + m[2].length + 1 });
      i++;
    } else if (!l.trim()) {
      const next = lines[i + 1];
      const lead = next === undefined ? 0 : next.length - next.trimStart().length;
      if (next === undefined || !next.trim() || lead < indent || (lead === indent && !RE_ITEM.test(next))) break;
      items[items.length - 1].lines.push('');
      loose = true;
      i++;
    } else {
      const lead = l.length - l.trimStart().length;
      if (lead <= indent && (m || startsBlock(lines, i))) break;
      const item = items[items.length - 1];
      item.lines.push(l.slice(Math.min(lead, item.pad)));
      i++;
    }
  }
  const tag = ordered ? 'ol' : 'ul';
  const start = ordered && parseInt(first[2], 10) !== 1 ? ` start="${parseInt(first[2], 10)}"` : '';
  let html = `<${tag}${start}>`;
  for (const it of items) {
    let body = renderMarkdown(it.lines.join('\n'));
    if (!loose) body = body.replace(/^<p>([\s\S]*?)<\/p>/, '$1');
    html += '<li>' + body + '</li>';
  }
  out.push(html + `</${tag}>`);
  return i;
}

function renderMarkdown(src) {
  const lines = String(src).replace(/\r\n?/g, '\n').replace(/\u0001/g, '').split('\n');
  const out = [];
  let i = 0, m;
  while (i < lines.length) {
    const line = lines[i];
    if ((m = RE_FENCE.exec(line))) {
      // An unclosed fence runs to the end: a reply still streaming shows its code block already.
      const fence = m[1], lang = m[2].toLowerCase(), body = [];
      for (i++; i < lines.length; i++) {
        const t = lines[i].trim();
        if (t.startsWith(fence) && t.replace(/[`~]/g, '') === '' && t[0] === fence[0]) { i++; break; }
        body.push(lines[i]);
      }
      const cls = /^[\w+#-]+$/.test(lang) ? ` class="lang-${lang}"` : '';
      out.push(`<pre><code${cls}>${highlight(body.join('\n'), lang)}</code></pre>`);
    } else if (!line.trim()) {
      i++;
    } else if ((m = RE_HEADING.exec(line))) {
      out.push(`<h${m[1].length}>${renderInline(m[2])}</h${m[1].length}>`);
      i++;
    } else if (RE_HR.test(line)) {
      out.push('<hr>');
      i++;
    } else if (isTableStart(lines, i)) {
      i = renderTable(lines, i, out);
    } else if (RE_QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && RE_QUOTE.test(lines[i])) body.push(lines[i++].replace(RE_QUOTE, ''));
      out.push('<blockquote>' + renderMarkdown(body.join('\n')) + '</blockquote>');
    } else if (RE_ITEM.test(line)) {
      i = renderList(lines, i, out);
    } else {
      const para = [line];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines, i); i++) para.push(lines[i]);
      out.push('<p>' + para.map(renderInline).join('<br>') + '</p>');
    }
  }
  return out.join('\n');
}

// ---- code highlighting: one regex per language, alternatives in the order comment, string,
// number, word; a word is a keyword when the language lists it.
const LANGS = {};
function lang(names, spec) {
  const strs = spec.strings || ['"(?:[^"\\\\\\n]|\\\\.)*"', "'(?:[^'\\\\\\n]|\\\\.)*'"];
  const num = '\\b(?:0[xX][\\da-fA-F_]+|0[bB][01_]+|\\d[\\d_]*(?:\\.\\d[\\d_]*)?(?:[eE][+-]?\\d+)?)[a-zA-Z]*\\b';
  const src = `(${spec.comments.join('|') || '(?!)'})|(${strs.join('|')})|(${num})|(${spec.word || '[A-Za-z_$][\\w$]*'})`;
  const def = { re: new RegExp(src, 'g'), kw: new Set(spec.keywords.split(/\s+/)) };
  for (const n of names.split(' ')) LANGS[n] = def;
}
const C_LINE = '//.*', C_BLOCK = '/\\*[\\s\\S]*?(?:\\*/|$)', HASH = '(?<![\\w$])#.*';
lang('python py python3 py3', {
  comments: [HASH],
  strings: ['[rbfuRBFU]{0,2}"""[\\s\\S]*?(?:"""|$)', "[rbfuRBFU]{0,2}'''[\\s\\S]*?(?:'''|$)",
    '[rbfuRBFU]{0,2}"(?:[^"\\\\\\n]|\\\\.)*"', "[rbfuRBFU]{0,2}'(?:[^'\\\\\\n]|\\\\.)*'"],
  keywords: 'False None True and as assert async await break class continue def del elif else except ' +
    'finally for from global if import in is lambda nonlocal not or pass raise return try while with ' +
    'yield match case self print len range int str float list dict set tuple bool',
});
lang('javascript js jsx typescript ts tsx mjs node', {
  comments: [C_LINE, C_BLOCK],
  strings: ['"(?:[^"\\\\\\n]|\\\\.)*"', "'(?:[^'\\\\\\n]|\\\\.)*'", '`(?:[^`\\\\]|\\\\.)*`'],
  keywords: 'async await break case catch class const continue debugger default delete do else export ' +
    'extends false finally for from function if import in instanceof let new null of return static super ' +
    'switch this throw true try typeof undefined var void while yield interface type enum implements ' +
    'public private protected readonly as any number string boolean',
});
lang('c h cpp c++ cc cxx hpp cuda cu objc', {
  comments: [C_LINE, C_BLOCK],
  word: '#\\s*[a-z]+|[A-Za-z_]\\w*',
  keywords: '#include #define #if #ifdef #ifndef #endif #else #elif #pragma #undef auto break case char ' +
    'const continue default do double else enum extern float for goto if inline int long register ' +
    'restrict return short signed sizeof static struct switch typedef union unsigned void volatile while ' +
    'bool true false NULL nullptr class namespace template typename public private protected virtual ' +
    'override new delete this using try catch throw constexpr noexcept size_t uint8_t uint16_t uint32_t ' +
    'uint64_t int8_t int16_t int32_t int64_t __global__ __device__ __host__ __shared__',
});
lang('rust rs', {
  comments: [C_LINE, C_BLOCK],
  strings: ['b?"(?:[^"\\\\]|\\\\.)*"', "b?'(?:[^'\\\\\\n]|\\\\.)'"],
  keywords: 'as async await break const continue crate dyn else enum extern false fn for if impl in let ' +
    'loop match mod move mut pub ref return self Self static struct super trait true type unsafe use ' +
    'where while Some None Ok Err Box Vec String Option Result',
});
lang('go golang', {
  comments: [C_LINE, C_BLOCK],
  strings: ['"(?:[^"\\\\\\n]|\\\\.)*"', "'(?:[^'\\\\\\n]|\\\\.)*'", '`[^`]*`'],
  keywords: 'break case chan const continue default defer else fallthrough for func go goto if import ' +
    'interface map package range return select struct switch type var nil true false error string int ' +
    'byte rune bool make new len cap append',
});
lang('java kotlin kt csharp cs c# scala swift dart', {
  comments: [C_LINE, C_BLOCK],
  keywords: 'abstract boolean break byte case catch char class const continue default do double else ' +
    'enum extends final finally float for if implements import instanceof int interface long native new ' +
    'null package private protected public return short static super switch synchronized this throw ' +
    'throws try void volatile while true false var val fun let func using namespace string override',
});
lang('bash sh shell zsh console shellsession', {
  comments: [HASH],
  strings: ['"(?:[^"\\\\]|\\\\.)*"', "'[^']*'"],
  word: '\\$?[A-Za-z_][\\w-]*',
  keywords: 'if then else elif fi for while until do done case esac in function return exit export local ' +
    'echo cd set unset source sudo apt apt-get pip git make cmake',
});
lang('json jsonc', { comments: [C_LINE], strings: ['"(?:[^"\\\\\\n]|\\\\.)*"'], keywords: 'true false null' });
lang('sql', {
  comments: ['--.*', C_BLOCK],
  keywords: 'select from where and or not insert into values update set delete create table index drop ' +
    'join left right inner outer on group by order having limit as null is in like distinct count ' +
    'SELECT FROM WHERE AND OR NOT INSERT INTO VALUES UPDATE SET DELETE CREATE TABLE INDEX DROP JOIN LEFT ' +
    'RIGHT INNER OUTER ON GROUP BY ORDER HAVING LIMIT AS NULL IS IN LIKE DISTINCT COUNT',
});

function highlight(code, name) {
  const def = LANGS[name];
  if (!def) return esc(code);
  const re = def.re;
  let out = '', last = 0, m;
  re.lastIndex = 0;
  while ((m = re.exec(code))) {
    if (m[0] === '') { re.lastIndex++; continue; }
    const cls = m[1] !== undefined ? 'c' : m[2] !== undefined ? 's' : m[3] !== undefined ? 'n' :
      def.kw.has(m[0]) ? 'k' : '';
    out += esc(code.slice(last, m.index)) + (cls ? `<span class="hl-${cls}">${esc(m[0])}</span>` : esc(m[0]));
    last = re.lastIndex;
  }
  return out + esc(code.slice(last));
}

// ============================================================================================
// Stored state: conversations and settings in localStorage (kept in memory if that fails)

const store = {
  load(key, dflt) {
    try { const v = JSON.parse(localStorage.getItem(key)); return v === null ? dflt : v; } catch { return dflt; }
  },
  save(key, v) { try { localStorage.setItem(key, JSON.stringify(v)); } catch { /* full or blocked */ } },
};
const uid = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

let convs = store.load('strata.conversations', []);
if (!Array.isArray(convs)) convs = [];
convs = convs.filter((c) => c && typeof c.id === 'string' && Array.isArray(c.messages));
for (const c of convs) {   // a reload in the middle of a reply leaves it marked as streaming
  for (const m of c.messages) if (m.streaming) { delete m.streaming; m.meta = 'interrupted'; }
}
let currentId = store.load('strata.current', null);
const settings = Object.assign({ temperature: 0.7, max_tokens: 1024, system: '', api_key: '' },
  store.load('strata.settings', {}));

function saveConvs() { store.save('strata.conversations', convs); store.save('strata.current', currentId); }
function current() { return convs.find((c) => c.id === currentId) || null; }
function titleOf(text) {
  const t = text.replace(/\s+/g, ' ').trim();
  return t.length > 48 ? t.slice(0, 47) + '…' : t || 'New chat';
}
function authHeaders() {
  return settings.api_key ? { Authorization: 'Bearer ' + settings.api_key } : {};
}

// ============================================================================================
// Chat view

const $ = (id) => document.getElementById(id);
let controller = null;   // the running request's AbortController, null when idle

function renderConvList() {
  const ul = $('conv-list');
  ul.textContent = '';
  for (const c of [...convs].sort((a, b) => b.updated - a.updated)) {
    const li = document.createElement('li');
    li.className = c.id === currentId ? 'current' : '';
    const open = document.createElement('button');
    open.type = 'button';
    open.className = 'open';
    open.textContent = c.title;
    open.title = c.title;
    if (c.id === currentId) open.setAttribute('aria-current', 'true');
    open.onclick = () => { currentId = c.id; saveConvs(); renderAll(); };
    const del = document.createElement('button');
    del.type = 'button';
    del.className = 'delete';
    del.textContent = '×';
    del.setAttribute('aria-label', 'Delete conversation: ' + c.title);
    del.onclick = () => deleteConv(c.id);
    li.append(open, del);
    ul.append(li);
  }
}

function deleteConv(id) {
  const c = convs.find((x) => x.id === id);
  if (!c || !confirm(`Delete "${c.title}"?`)) return;
  if (controller && c.messages.some((m) => m.streaming)) controller.abort();
  convs = convs.filter((x) => x.id !== id);
  if (currentId === id) currentId = null;
  saveConvs();
  renderAll();
}

function messageEl(m) {
  const div = document.createElement('div');
  div.className = 'msg ' + (m.role === 'user' ? 'user' : 'assistant') + (m.error ? ' error' : '');
  div.dataset.mid = m.id;
  if (m.role === 'user') {
    div.textContent = m.content;
    return div;
  }
  const details = document.createElement('details');
  details.className = 'reasoning';
  details.hidden = true;
  details.innerHTML = '<summary>Reasoning</summary><div class="text"></div>';
  const content = document.createElement('div');
  content.className = 'content';
  const meta = document.createElement('div');
  meta.className = 'meta';
  div.append(details, content, meta);
  updateMessageEl(div, m);
  return div;
}

function updateMessageEl(div, m) {
  const [details, content, meta] = div.children;
  if (m.reasoning) {
    details.hidden = false;
    details.querySelector('summary').textContent = m.streaming && !m.content ? 'Thinking…' : 'Reasoning';
    details.querySelector('.text').textContent = m.reasoning;
  }
  if (m.error) content.textContent = m.error;
  else if (!m.streaming && !m.content && !m.reasoning) content.innerHTML = '<p class="muted">(empty reply)</p>';
  else content.innerHTML = renderMarkdown(m.content);
  let live = '…';
  const p = m.progress;
  if (p && !m.content && !m.reasoning && p.total > 0)   // a long prompt being read: how far
    live = `reading the prompt: ${fmtNum(p.processed)} of ${fmtNum(p.total)} tokens` +
      (p.cache ? ` (${fmtNum(p.cache)} from the cache)` : '');
  meta.textContent = m.meta || (m.streaming ? live : '');
  div.classList.toggle('error', !!m.error);
  div.setAttribute('aria-busy', m.streaming ? 'true' : 'false');   // screen readers wait for the whole reply
}

function renderMessages() {
  const box = $('messages');
  const c = current();
  box.querySelectorAll('.msg').forEach((e) => e.remove());
  $('empty-hint').hidden = !!(c && c.messages.length);
  if (c) for (const m of c.messages) box.append(messageEl(m));
  box.scrollTop = box.scrollHeight;
}

function renderAll() { renderConvList(); renderMessages(); }

// Repaints a streaming reply at most once per frame; follows the bottom unless the reader scrolled up.
let pending = new Set();
function scheduleUpdate(m) {
  if (pending.has(m)) return;
  pending.add(m);
  requestAnimationFrame(() => {
    pending.delete(m);
    const div = document.querySelector(`[data-mid="${m.id}"]`);
    if (!div) return;
    const box = $('messages');
    const follow = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    updateMessageEl(div, m);
    if (follow) box.scrollTop = box.scrollHeight;
  });
}

function setBusy(busy) {
  $('send').hidden = busy;
  $('stop').hidden = !busy;
  if (!busy) $('input').focus();
}

// Server-sent events: calls onData with each parsed `data:` payload until [DONE] or the end.
async function readSSE(res, onData) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = '';
  for (;;) {
    const { done, value } = await reader.read();
    buf += done ? dec.decode() : dec.decode(value, { stream: true });
    buf = buf.replace(/\r\n?(?=[\s\S])/g, '\n');   // a lone trailing \r may be half of \r\n
    let cut;
    while ((cut = buf.indexOf('\n\n')) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event.split('\n').filter((l) => l.startsWith('data:'))
        .map((l) => l.slice(5).replace(/^ /, '')).join('\n');
      if (!data) continue;
      if (data === '[DONE]') return;
      onData(JSON.parse(data));
    }
    if (done) return;
  }
}

async function errorText(res) {
  const text = await res.text().catch(() => '');
  try { const j = JSON.parse(text); if (j.error) return `${res.status}: ${j.error.message || j.error}`; } catch { /* not JSON */ }
  return `${res.status} ${res.statusText}${text ? ': ' + text.slice(0, 300) : ''}`;
}

async function send(text) {
  if (controller || !text.trim()) return;
  let c = current();
  if (!c) {
    c = { id: uid(), title: 'New chat', messages: [], updated: Date.now() };
    convs.push(c);
    currentId = c.id;
  }
  if (!c.messages.some((m) => m.role === 'user')) c.title = titleOf(text);
  c.messages.push({ id: uid(), role: 'user', content: text });
  const reply = { id: uid(), role: 'assistant', content: '', reasoning: '', streaming: true };
  const history = c.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  c.messages.push(reply);
  c.updated = Date.now();
  saveConvs();
  renderAll();

  const body = { messages: history, stream: true, stream_options: { include_usage: true }, return_progress: true };
  if (settings.system.trim()) body.messages.unshift({ role: 'system', content: settings.system });
  if (settings.temperature !== '' && settings.temperature !== null) body.temperature = Number(settings.temperature);
  if (settings.max_tokens) body.max_tokens = Number(settings.max_tokens);

  controller = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  let tFirst = 0, usage = null, pieces = 0, stopped = false;
  try {
    const res = await fetch('/v1/chat/completions', {
      method: 'POST', signal: controller.signal, body: JSON.stringify(body),
      headers: { 'Content-Type': 'application/json', ...authHeaders() },
    });
    if (!res.ok) throw new Error(await errorText(res));
    await readSSE(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      if (chunk.prompt_progress) { reply.progress = chunk.prompt_progress; scheduleUpdate(reply); }
      const d = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      if (d.reasoning_content || d.content) {
        if (!tFirst) tFirst = performance.now();
        pieces++;
        reply.reasoning += d.reasoning_content || '';
        reply.content += d.content || '';
        scheduleUpdate(reply);
      }
    });
  } catch (e) {
    if (e.name === 'AbortError') stopped = true;
    else reply.error = 'Error: ' + (e.message || e);
  }
  const n = usage ? usage.completion_tokens : pieces;
  const secs = tFirst ? (performance.now() - tFirst) / 1000 : 0;
  const parts = [];
  if (n) parts.push(`${n} tokens`);
  if (n > 1 && secs > 0) parts.push(`${(n / secs).toFixed(1)} tokens/s`);
  if (tFirst) parts.push(`first token after ${((tFirst - t0) / 1000).toFixed(2)} s`);
  if (stopped) parts.push('stopped');
  reply.meta = parts.join(' · ');
  delete reply.streaming;
  delete reply.progress;
  controller = null;
  saveConvs();
  scheduleUpdate(reply);
  setBusy(false);
}

function initChat() {
  const input = $('input');
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    const text = input.value;
    if (!text.trim() || controller) return;
    input.value = '';
    send(text);
  });
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $('composer').requestSubmit();
    }
  });
  $('stop').onclick = () => controller && controller.abort();
  $('new-chat').onclick = () => { currentId = null; saveConvs(); renderAll(); input.focus(); };

  const fields = { temperature: 'set-temperature', max_tokens: 'set-max-tokens', system: 'set-system', api_key: 'set-api-key' };
  for (const [key, id] of Object.entries(fields)) {
    const el = $(id);
    el.value = settings[key];
    el.addEventListener('change', () => { settings[key] = el.value; store.save('strata.settings', settings); });
  }
  renderAll();
}

// ============================================================================================
// Monitor view: /status every second while the tab is shown

const HISTORY = 60;   // samples kept for the sparklines: one minute at one poll a second
const hist = { decode: [], prompt: [] };
let monTimer = null;

function fmtBytes(n) {
  if (!(n >= 0)) return '–';
  const units = ['B', 'KB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + ' ' + units[i];
}
function fmtNum(n) { return typeof n === 'number' ? n.toLocaleString('en-US') : '–'; }
function fmtTps(n) { return typeof n === 'number' ? (n >= 100 ? n.toFixed(0) : n.toFixed(1)) : '–'; }
function fmtUptime(s) {
  s = Math.floor(s || 0);
  const h = Math.floor(s / 3600), m = Math.floor(s / 60) % 60;
  return (h ? h + ' h ' : '') + (h || m ? m + ' min ' : '') + (s % 60) + ' s';
}
function pct(a, b) { return b > 0 ? Math.round((100 * a) / b) + '%' : '–'; }

function sparkline(canvas, values) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (!w || !h) return;
  canvas.width = w * dpr;
  canvas.height = h * dpr;
  const g = canvas.getContext('2d');
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  if (values.length < 2) return;
  const max = Math.max(1, ...values);
  const x = (i) => (i / (HISTORY - 1)) * w, y = (v) => h - 2 - (v / max) * (h - 4);
  const off = HISTORY - values.length;
  g.beginPath();
  values.forEach((v, i) => (i ? g.lineTo(x(i + off), y(v)) : g.moveTo(x(i + off), y(v))));
  g.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue('--accent').trim() || '#2a5db0';
  g.lineWidth = 1.5;
  g.stroke();
  g.lineTo(x(HISTORY - 1), h);
  g.lineTo(x(off), h);
  g.closePath();
  g.globalAlpha = 0.15;
  g.fillStyle = g.strokeStyle;
  g.fill();
}

function bar(label, value, used, total) {
  const div = document.createElement('div');
  div.className = 'bar';
  const top = document.createElement('div');
  top.className = 'label';
  const a = document.createElement('span'), b = document.createElement('span');
  a.textContent = label;
  b.textContent = value;
  top.append(a, b);
  const meter = document.createElement('meter');
  meter.min = 0;
  meter.max = total > 0 ? total : 1;
  meter.value = Math.min(Math.max(used || 0, 0), meter.max);
  meter.setAttribute('aria-label', label);
  div.append(top, meter);
  return div;
}

function showStatus(s) {
  const set = (id, text) => { $(id).textContent = text; };
  const speed = s.speed || {};
  set('m-decode', fmtTps(speed.decode_tps));
  set('m-prompt', fmtTps(speed.prompt_tps));
  for (const [k, v] of [['decode', speed.decode_tps], ['prompt', speed.prompt_tps]]) {
    hist[k].push(typeof v === 'number' ? v : 0);
    if (hist[k].length > HISTORY) hist[k].shift();
  }
  sparkline($('spark-decode'), hist.decode);
  sparkline($('spark-prompt'), hist.prompt);

  const q = s.queue || {}, r = s.requests || {}, t = s.tokens || {}, pc = s.prompt_cache || {};
  set('m-queue', `${fmtNum(q.depth)} waiting (limit ${fmtNum(q.limit)})`);
  set('m-active', fmtNum(r.active));
  set('m-total', fmtNum(r.total));
  set('m-errors', fmtNum(r.errors));
  set('m-tok-prompt', fmtNum(t.prompt));
  set('m-tok-gen', fmtNum(t.generated));
  const lookups = (pc.hits || 0) + (pc.misses || 0);
  set('m-pcache', lookups ? `${pct(pc.hits, lookups)} hits (${fmtNum(pc.hits)} of ${fmtNum(lookups)})` : 'no lookups yet');
  set('m-ecache', s.expert_cache && typeof s.expert_cache.hit_rate === 'number'
    ? (100 * s.expert_cache.hit_rate).toFixed(1) + '% hits' : 'no expert cache');
  set('m-model', s.model || '–');
  set('m-backend', s.backend || '–');
  set('m-ctx', `${fmtNum(s.ctx)} tokens × ${fmtNum(s.parallel)} slot${s.parallel === 1 ? '' : 's'}`);
  set('m-uptime', fmtUptime(s.uptime_s));

  const slots = $('m-slots');
  slots.textContent = '';
  for (const sl of s.slots || []) {
    const li = document.createElement('li');
    const a = document.createElement('span'), b = document.createElement('span');
    a.textContent = `Slot ${sl.id}: `;
    b.textContent = `${sl.state}, ${fmtNum(sl.n_past)} tokens in context`;
    b.className = 'state-' + String(sl.state).replace(/[^a-z]/g, '');
    li.append(a, b);
    slots.append(li);
  }

  const sys = s.system || {}, box = $('m-system');
  box.textContent = '';
  box.append(bar('CPU', typeof sys.cpu_percent === 'number' ? sys.cpu_percent.toFixed(0) + '%' : '–', sys.cpu_percent, 100));
  box.append(bar('RAM', `${fmtBytes(sys.ram_used_bytes)} of ${fmtBytes(sys.ram_total_bytes)} (Strata ${fmtBytes(sys.process_rss_bytes)})`,
    sys.ram_used_bytes, sys.ram_total_bytes));
  for (const gpu of sys.gpus || []) {
    box.append(bar(`GPU ${gpu.index}: ${gpu.name} VRAM`, `${fmtBytes(gpu.vram_used_bytes)} of ${fmtBytes(gpu.vram_total_bytes)}`,
      gpu.vram_used_bytes, gpu.vram_total_bytes));
    box.append(bar(`GPU ${gpu.index} load`, typeof gpu.util_percent === 'number' ? gpu.util_percent.toFixed(0) + '%' : '–',
      gpu.util_percent, 100));
  }
  if (!(sys.gpus || []).length) {
    const p = document.createElement('p');
    p.className = 'muted';
    p.textContent = 'No GPU in use.';
    box.append(p);
  }
}

// One poll at a time: a tab switch while a request is out does not start a second loop.
let monBusy = false;
async function poll() {
  clearTimeout(monTimer);
  if (monBusy) return;
  monBusy = true;
  try {
    const res = await fetch('/status', { headers: authHeaders(), cache: 'no-store' });
    if (!res.ok) throw new Error(await errorText(res));
    showStatus(await res.json());
    $('mon-error').hidden = true;
  } catch (e) {
    $('mon-error').textContent = 'Cannot read /status: ' + (e.message || e);
    $('mon-error').hidden = false;
  }
  monBusy = false;
  if (!$('panel-monitor').hidden) monTimer = setTimeout(poll, 1000);
}

// ============================================================================================
// Tabs (the hash keeps the choice across reloads)

function selectTab(name) {
  for (const n of ['chat', 'monitor']) {
    const on = n === name, tab = $('tab-' + n);
    tab.setAttribute('aria-selected', on);
    tab.tabIndex = on ? 0 : -1;
    $('panel-' + n).hidden = !on;
  }
  history.replaceState(null, '', name === 'chat' ? location.pathname : '#monitor');
  if (name === 'monitor') poll();
  if (name === 'chat') $('input').focus();
}

function initTabs() {
  const tabs = ['chat', 'monitor'];
  tabs.forEach((n, k) => {
    const tab = $('tab-' + n);
    tab.onclick = () => selectTab(n);
    tab.onkeydown = (e) => {
      const d = e.key === 'ArrowRight' ? 1 : e.key === 'ArrowLeft' ? -1 : 0;
      if (!d) return;
      const next = tabs[(k + d + tabs.length) % tabs.length];
      selectTab(next);
      $('tab-' + next).focus();
    };
  });
  selectTab(location.hash === '#monitor' ? 'monitor' : 'chat');
}

async function showModelName() {
  try {
    const res = await fetch('/status', { headers: authHeaders(), cache: 'no-store' });
    if (!res.ok) return;
    const s = await res.json();
    $('model-name').textContent = `${s.model} · ${s.backend === 'cuda' ? 'GPU' : 'CPU'}`;
  } catch { /* the monitor tab says why */ }
}

// Exposed for the browser test and for poking at in the console.
window.Strata = { renderMarkdown, renderInline, highlight, esc };

initChat();
initTabs();
showModelName();
