"""The report's sample browser: per task, its samples with each model's (and each output's) completion,
score and status, the rows where they disagree first.

A row is one (task, sample_id, completion); its cells are the columns of the comparison (cluster/report/
comparison.py): each model of each output. Rows are ordered: the columns disagree (on score or on status)
first, then rows some column did not get ok, then the rest, each by sample id (its digits as numbers). At most `limit`
rows per task go on the page (the page says how many there are), so a sweep of millions of rows makes a
page of a few megabytes: only the key columns of every row are read, and the texts of the rows shown.
The rows travel as JSON inside the page; a small script draws them, filters (status, score, disagreement,
text) and pages them. Texts are cut at TEXT_CHARS characters, saying how many more there were.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pyarrow.compute as pc

from cluster.report.comparison import Output, column_label
from cluster.report.html_parts import note, section
from cluster.report.reading import columns_of, committed

LIMIT = 200  # rows per task on the page
TEXT_CHARS = 1500
KEYS = ["model", "task", "sample_id", "completion", "status", "score"]
TEXTS = ["model", "sample_id", "completion", "prompt", "output_text", "target", "error", "exec_status",
         "exec_error", "finish_reason"]


def browser(outputs: list[Output], limit: int = LIMIT) -> str:
    data = sample_rows(outputs, limit)
    if not data["tasks"]:
        return section("Samples", "samples", note("No committed result shards: no sample to show."))
    # <, > and & as JSON escapes: no text of a row can end the script element or read as markup
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":")) \
        .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return section("Samples", "samples", f"""<div id="browser">
<div class="controls"><label>task <select id="f-task"></select></label>
<label>status <select id="f-status"><option value="">any</option><option value="not-ok">not ok</option>
<option>ok</option><option>truncated</option><option>skipped</option><option>error</option></select></label>
<label>score <select id="f-score"><option value="">any</option><option value="1">1</option>
<option value="0">0</option><option value="between">between 0 and 1</option><option value="none">not scored</option>
</select></label><label><input type="checkbox" id="f-disagree"> disagreements only</label>
<label>text <input id="f-text" size="16"></label>
<button id="f-prev">◀</button><span id="f-page"></span><button id="f-next">▶</button></div>
<p id="browser-count"></p>
<noscript><p class="note">The sample browser needs JavaScript; the rows are in this file as JSON
(script id samples-data), and in the output's Parquet files.</p></noscript>
<table id="sample-browser"><thead></thead><tbody></tbody></table></div>
<script type="application/json" id="samples-data">{payload}</script>
<script>{SCRIPT}</script>""")


def sample_rows(outputs: list[Output], limit: int = LIMIT) -> dict:
    """{"columns": [label], "tasks": {task: {"rows": N, "disagree": D, "shown": [row]}}}; a row is
    {"id", "completion", "disagree", "prompt", "target", "cells": [cell or null per column]}."""
    columns: list[tuple[int, str]] = []
    keyed: dict[str, dict[tuple, dict[tuple[int, str], tuple]]] = defaultdict(lambda: defaultdict(dict))
    datasets = []
    for k, out in enumerate(outputs):
        dataset = committed(out.root, out.manifest)
        datasets.append(dataset)
        if dataset is None:
            continue
        t = columns_of(dataset, KEYS)
        cols = {c: t[c].to_pylist() for c in KEYS}
        for model, task, sid, comp, status, score in zip(*(cols[c] for c in KEYS)):
            if (k, model) not in columns:
                columns.append((k, model))
            keyed[task][(sid, comp or 0)][(k, model)] = (status, score)
    columns.sort()  # by output, then model: the comparison's order (summary.parquet is sorted by model)
    tasks = {}
    for task, by_key in keyed.items():
        ranked = []
        for key, cells in by_key.items():
            scores = {s for _, s in cells.values() if s is not None}
            statuses = {st for st, _ in cells.values()}
            disagree = len(cells) > 1 and (len(scores) > 1 or len(statuses) > 1)
            problem = any(st != "ok" for st in statuses)
            ranked.append((0 if disagree else 1 if problem else 2, _natural(key[0]), key[1], key, disagree))
        ranked.sort()
        shown = ranked[:limit]
        texts = _texts(datasets, task, {r[3] for r in shown})
        rows = []
        for *_, key, disagree in shown:
            cells = [None if c not in by_key[key] else _cell(by_key[key][c], texts.get((c, key))) for c in columns]
            first = next((texts[(c, key)] for c in columns if (c, key) in texts), {})
            for cell in cells:  # a prompt rendered alike for every model is kept once, on the row
                if cell is not None and cell["prompt"] == first.get("prompt"):
                    del cell["prompt"]
            rows.append({"id": key[0], "completion": key[1], "disagree": disagree,
                         "prompt": _cut(first.get("prompt")), "target": _cut(first.get("target")), "cells": cells})
        tasks[task] = {"rows": len(ranked), "disagree": sum(1 for r in ranked if r[4]), "shown": rows}
    return {"columns": [column_label(outputs, c) for c in columns], "tasks": tasks, "limit": limit,
            "text_chars": TEXT_CHARS}


def _texts(datasets: list, task: str, keys: set) -> dict:
    """(column, key) -> the row's texts, read for the shown rows of one task only."""
    found = {}
    ids = sorted({sid for sid, _ in keys})
    for k, dataset in enumerate(datasets):
        if dataset is None or not ids:
            continue
        wanted = [c for c in TEXTS if c in dataset.schema.names]
        t = dataset.to_table(columns=wanted, filter=(pc.field("task") == task) & pc.field("sample_id").isin(ids))
        for r in t.to_pylist():
            key = (r["sample_id"], r.get("completion") or 0)
            if key in keys:
                found[((k, r["model"]), key)] = r
    return found


def _cell(status_score: tuple, texts: dict | None) -> dict:
    status, score = status_score
    texts = texts or {}
    why = texts.get("error") or texts.get("exec_error")
    return {"status": status, "score": score, "output": _cut(texts.get("output_text")), "prompt": texts.get("prompt"),
            "why": _cut(why), "exec": texts.get("exec_status"), "finish": texts.get("finish_reason")}


def _natural(sample_id) -> tuple:
    """A sample id's sort key with its digits as numbers: q2 before q10, arith-011 before arith-142."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(sample_id)))


def _cut(text: str | None) -> str | None:
    if text is None or len(text) <= TEXT_CHARS:
        return text
    return text[:TEXT_CHARS] + f"… ({len(text) - TEXT_CHARS} more characters)"


SCRIPT = r"""(function(){
const data=JSON.parse(document.getElementById('samples-data').textContent);
const $=id=>document.getElementById(id), PAGE=50; let page=0;
const tasks=Object.keys(data.tasks);
for(const t of tasks){const o=document.createElement('option');o.textContent=t;$('f-task').appendChild(o);}
function el(tag,text,cls){const e=document.createElement(tag);if(text!==undefined&&text!==null)e.textContent=text;
  if(cls)e.className=cls;return e;}
function keep(row){
  const st=$('f-status').value, sc=$('f-score').value, q=$('f-text').value.toLowerCase();
  if($('f-disagree').checked&&!row.disagree)return false;
  const cells=row.cells.filter(c=>c);
  if(st&&!cells.some(c=>st==='not-ok'?c.status!=='ok':c.status===st))return false;
  if(sc&&!cells.some(c=>sc==='none'?c.score===null:sc==='between'?(c.score!==null&&c.score>0&&c.score<1)
      :c.score===Number(sc)))return false;
  if(q&&![row.id,row.prompt,row.target].concat(cells.map(c=>c.output)).some(v=>v&&String(v).toLowerCase().includes(q)))
    return false;
  return true;}
function draw(){
  const t=data.tasks[$('f-task').value]; const rows=t.shown.filter(keep);
  const pages=Math.max(1,Math.ceil(rows.length/PAGE)); page=Math.min(page,pages-1);
  $('f-page').textContent=` page ${page+1} of ${pages} `;
  $('browser-count').textContent=`${t.rows} row(s) in this task, ${t.disagree} where the columns disagree; `+
    `${t.shown.length===t.rows?'all are':'the first '+t.shown.length+' (disagreements first) are'} in this page, `+
    `${rows.length} match the filters.`;
  const head=$('sample-browser').tHead, body=$('sample-browser').tBodies[0]; head.innerHTML='';body.innerHTML='';
  const hr=head.insertRow(); for(const h of ['sample','prompt','target'].concat(data.columns))hr.appendChild(el('th',h));
  for(const row of rows.slice(page*PAGE,(page+1)*PAGE)){
    const tr=body.insertRow(); if(row.disagree)tr.className='disagree';
    tr.appendChild(el('td',row.completion?`${row.id} #${row.completion}`:row.id));
    tr.appendChild(el('td',row.prompt,'text')); tr.appendChild(el('td',row.target,'text'));
    for(const c of row.cells){
      if(!c){tr.appendChild(el('td','—'));continue;}
      const td=el('td',null,'text');
      td.appendChild(el('b',`${c.status} · score ${c.score===null?'—':c.score}`+(c.exec?` · ${c.exec}`:'')));
      td.appendChild(document.createElement('br')); td.appendChild(document.createTextNode(c.output===null?'(no output)':c.output));
      if(c.why){td.appendChild(document.createElement('br'));td.appendChild(el('i',c.why));}
      if(c.prompt){td.appendChild(document.createElement('br'));td.appendChild(el('i','prompt: '+c.prompt));}
      tr.appendChild(td);}
  }}
for(const id of ['f-task','f-status','f-score','f-disagree','f-text'])
  $(id).addEventListener(id==='f-text'?'input':'change',()=>{page=0;draw();});
$('f-prev').onclick=()=>{page=Math.max(0,page-1);draw();}; $('f-next').onclick=()=>{page++;draw();};
draw();})();"""
