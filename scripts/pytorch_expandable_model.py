"""A model of PyTorch 2.x's CUDACachingAllocator with `expandable_segments:True`, for one stream:
enough to give the peak reserved bytes of an alloc/free trace (`traces/*.trace.csv`) without a
GPU or PyTorch. It follows CUDACachingAllocator.cpp: sizes rounded to 512 B, the small pool up to
1 MiB (2 MiB pages) and the large pool (20 MiB pages), best fit by (size, address) where a free
block followed by unmapped space ranks as its size plus that space's (`expandable_size`, the
"tail rule"), `find_expandable_block` and `map_block` when nothing fits, PyTorch's split rule
(a large block is split only when more than 1 MiB remains), merging of free mapped neighbours.
Not modelled: releases (empty_cache, out-of-memory), streams, events, max_split_size.

Checked against PyTorch's own figures (`traces/pytorch_figures.json`, H100, expandable segments'
peak reserved): resnet50 5,932,843,008 B against 5,949,620,224; gpt2 8,839,495,680 against
8,835,301,376; vit_b16 3,621,781,504 against 3,617,587,200 (without the tail rule 3,705,667,584);
bert_infer 1,040,187,392 against 1,035,993,088 (`bert_infer.figures.json`; without the rule
977,272,832).

    python3 scripts/pytorch_expandable_model.py TRACE.csv [CAPACITY_GIB]

prints peak live and peak reserved with the tail rule and without it."""
import sys, bisect, csv
MiB=1<<20
K_SMALL=1*MiB; SMALL_BUF=2*MiB; LARGE_BUF=20*MiB; MIN=512
def round_size(s): return MIN if s<MIN else (s+MIN-1)//MIN*MIN
class B:
    __slots__=('ptr','size','alloc','mapped','prev','next','small')
    def __init__(s,ptr,size,small,mapped):
        s.ptr=ptr;s.size=size;s.alloc=False;s.mapped=mapped;s.prev=None;s.next=None;s.small=small
class Pool:
    def __init__(s,small):
        s.small=small; s.free=[]; s.unmapped=[]  # sorted lists of (size,ptr,b) / (ptr,b)
    def add(s,b): bisect.insort(s.free,(b.size,b.ptr,id(b),b))
    def rm(s,b): s.free.remove((b.size,b.ptr,id(b),b))
    def addu(s,b): bisect.insort(s.unmapped,(b.ptr,id(b),b))
    def rmu(s,b): s.unmapped.remove((b.ptr,id(b),b))
class Alloc:
    def __init__(s,total, tail_rule=True):
        s.total=total; s.reserved=0; s.peak=0; s.pools=[Pool(True),Pool(False)]; s.base=1<<40
        s.tail_rule=tail_rule
    def es_size(s,b): return b.size+(b.next.size if b.next and not b.next.mapped else 0)
    def get_free(s,p,size):
        i=bisect.bisect_left(p.free,(size,-1,-1))
        if i>=len(p.free): return None
        if s.tail_rule:
            while i+1<len(p.free) and s.es_size(p.free[i+1][3])<s.es_size(p.free[i][3]): i+=1
        b=p.free[i][3]; p.rm(b); return b
    def new_segment(s,p):
        size=s.total+s.total//8
        b=B(s.base,size,p.small,False); s.base+= (size//LARGE_BUF+2)*LARGE_BUF; p.addu(b); return b
    def map_block(s,p,b,size):
        seg=SMALL_BUF if p.small else LARGE_BUF
        # pages are aligned to segment size relative to the segment base; bases are aligned
        end=-(-(b.ptr+size)//seg)*seg; begin=b.ptr//seg*seg
        msize=min(end-b.ptr,b.size)
        s.reserved+=msize; s.peak=max(s.peak,s.reserved)
        p.rmu(b)
        if msize<b.size:
            r=B(b.ptr+msize,b.size-msize,p.small,False); r.prev=b;r.next=b.next
            if b.next: b.next.prev=r
            b.next=r; b.size=msize; p.addu(r)
        b.mapped=True
        b=s.merge(p,b)  # with free mapped neighbours
        return b
    def merge(s,p,b):
        pv=b.prev
        if pv and not pv.alloc and pv.mapped and pv is not b:
            p.rm(pv); pv.size+=b.size; pv.next=b.next
            if b.next: b.next.prev=pv
            b=pv
        nx=b.next
        if nx and not nx.alloc and nx.mapped:
            p.rm(nx); b.size+=nx.size; b.next=nx.next
            if nx.next: nx.next.prev=b
        return b
    def find_expandable(s,p,size):
        ok=lambda b: b is not None and not b.alloc
        for ptr,_,c in list(p.unmapped):
            if ok(c.prev) and c.prev.mapped: c=c.prev
            n=0;x=c
            while n<size and ok(x): n+=x.size; x=x.next
            if n>=size: return c
        return s.new_segment(p)
    def alloc_expandable(s,p,size):
        c=s.find_expandable(p,size)
        if not c.mapped:
            c=s.map_block(p,c,min(c.size,size))
        else:
            p.rm(c)
        while c.size<size:
            nx=c.next; rem=size-c.size
            c.alloc=True  # keep it out of merge bookkeeping of pool
            c2=s.map_block(p,nx,min(rem,nx.size))
            # map_block merged nx with its free mapped prev (c) only if c is free: emulate
            c.alloc=False
            # merge c and c2
            if c2 is not c:
                c.size+=c2.size; c.next=c2.next
                if c2.next: c2.next.prev=c
            # c2 may have been added? it wasn't added to free
        return c
    def malloc(s,req):
        size=round_size(req); small=size<=K_SMALL; p=s.pools[0 if small else 1]
        b=s.get_free(p,size)
        if b is None:
            b=s.alloc_expandable(p,size)
        rem=b.size-size
        if (small and rem>=MIN) or (not small and rem>K_SMALL):
            r=B(b.ptr+size,rem,small,True); r.prev=b; r.next=b.next
            if b.next: b.next.prev=r
            b.next=r; b.size=size; p.add(r)
        b.alloc=True; return b
    def free(s,b):
        p=s.pools[0 if b.small else 1]; b.alloc=False
        b=s.merge(p,b); p.add(b)

def run(path,total,tail_rule=True):
    a=Alloc(total,tail_rule); live={}; cur=0; peak=0
    with open(path) as f:
        r=csv.reader(f); next(r)
        for row in r:
            op,i,n=row[0],row[1],int(row[2])
            if op=='a':
                live[i]=(a.malloc(n),n); cur+=n; peak=max(peak,cur)
            elif i in live:
                b,n=live.pop(i); a.free(b); cur-=n
    return peak,a.peak
if __name__=='__main__':
    if len(sys.argv) not in (2,3):
        sys.exit("usage: pytorch_expandable_model.py TRACE.csv [CAPACITY_GIB]")
    total=int(float(sys.argv[2])*(1<<30)) if len(sys.argv)>2 else 80<<30
    for tr in (True,False):
        pk,pr=run(sys.argv[1],total,tr)
        print(f"tail_rule={tr}: peak live {pk} peak reserved {pr} ratio {pr/pk:.4f} ({pr/2**30:.2f} GiB)")
